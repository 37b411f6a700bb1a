"""ContextAssembler: deduplication, exact spans, token budget, order, citations, LlamaIndex use."""

from __future__ import annotations

import copy
import functools
import re
from typing import Dict, List, Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core.llms import MockLLM
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.schema import Document, MetadataMode, NodeWithScore, TextNode

from llama_index_retrieval_kit import SectionWindowNodeParser
from llama_index_retrieval_kit.node_parser.metadata import page_of
from llama_index_retrieval_kit.node_parser.section_hierarchy import SectionHierarchyNodeParser
from llama_index_retrieval_kit.node_parser.tokenization import count_tokens_fn
from llama_index_retrieval_kit.models import DEFAULT_EMBED_MODEL
from llama_index_retrieval_kit.postprocessor.context import (
    AssemblyReport,
    Chunk,
    ContextAssembler,
    ContextOrder,
    HintStyle,
    Span,
    citation_hints,
    citation_text,
    cut_at_sentence,
    merge_spans,
    order_spans,
    page_text,
)
from llama_index_retrieval_kit.postprocessor.rerank import RerankedNodeWithScore
from llama_index_retrieval_kit.retrievers.fusion import FusedNodeWithScore

from ..indices import _support


@functools.lru_cache(maxsize=1)
def real_count():
    """The embedding model's tokenizer, loaded independently of the assembler."""
    return count_tokens_fn(DEFAULT_EMBED_MODEL)


def llm_text(result: NodeWithScore) -> str:
    return result.node.get_content(metadata_mode=MetadataMode.LLM)


def body(result: NodeWithScore) -> str:
    """The node text without its citation hint."""
    return result.node.get_content(metadata_mode=MetadataMode.NONE)[result.node.metadata["hint_chars"] :]


def check_context(out: Sequence[NodeWithScore], docs: Dict[str, Document], max_tokens: int) -> None:
    """The invariants every assembled context keeps."""
    count = real_count()
    assert sum(count(llm_text(r)) for r in out) <= max_tokens
    taken: Dict[str, List[tuple]] = {}
    for r in out:
        meta = r.node.metadata
        doc = docs[meta["doc_id"]]
        start, end = meta["char_start"], meta["char_end"]
        assert doc.text[start:end] == body(r), "span is not the exact source text"
        for s, e in taken.get(meta["doc_id"], []):
            assert end <= s or e <= start, f"spans [{s},{e}) and [{start},{end}) repeat source text"
        taken.setdefault(meta["doc_id"], []).append((start, end))
        # Citation: the LLM sees it; its pages hold the span's pages.
        if not meta["citation"]:  # hint_style "none" (or include_hint=False)
            assert meta["hint_chars"] == 0 and llm_text(r) == body(r)
            continue
        assert llm_text(r).startswith(meta["citation"] + "\n")
        page_starts = doc.metadata.get("page_starts") or []
        first, last = page_of(page_starts, start), page_of(page_starts, max(start, end - 1))
        assert (meta["page_start"], meta["page_end"]) == (first, last)  # cut spans too (the chunks' page_breaks)
        pages = f"p. ?{first}" if meta["page_start"] == meta["page_end"] else f"pp. ?{meta['page_start']}-{meta['page_end']}"
        assert re.search(rf"[\[ ]{pages}\]$", meta["citation"]), meta["citation"]
        # Bookkeeping stays out of the LLM text.
        assert "source_node_ids" not in llm_text(r) and "char_start" not in llm_text(r)


# ------------------------------------------------------------------------------ pure functions
def _chunk(node_id: str, start: int, text: str, score: float, rank: int, path=("1. A",), **kw) -> Chunk:
    return Chunk(node_id, "d", start, start + len(text), text, score, rank, tuple(path), 1, 1, "d.txt", "d.txt", **kw)


def test_merge_spans_overlap_adjacent_gap_duplicate():
    source = "Alpha beta gamma. Delta epsilon zeta. Eta theta iota. Kappa lambda mu."
    a = _chunk("a", 0, source[0:30], 0.5, 0)
    b = _chunk("b", 18, source[18:50], 0.9, 1)  # overlaps a
    c = _chunk("c", 50, source[50:60], 0.1, 2)  # touches b, same section
    d = _chunk("d", 20, source[20:28], 0.3, 3)  # inside b
    e = _chunk("e", 64, source[64:], 0.2, 4)  # gap after c
    spans, dups = merge_spans([a, b, c, d, e, b])
    assert [(s.start, s.end) for s in spans] == [(0, 60), (64, len(source))]
    assert spans[0].text == source[0:60] and spans[1].text == source[64:]
    assert spans[0].score == 0.9
    assert dups == {"d": "b", "b": "b"}


def test_merge_spans_adjacent_other_section_stays_apart_and_parent_fills_gap():
    source = "One two three. Four five six. Seven eight nine."
    a = _chunk("a", 0, source[0:14], 1.0, 0, path=("1. A",))
    b = _chunk("b", 14, source[14:29], 1.0, 1, path=("2. B",))
    assert len(merge_spans([a, b])[0]) == 2
    parent = dict(parent_id="p", parent_start=0, parent_text=source)
    x = _chunk("x", 0, source[0:10], 1.0, 0, **parent)
    y = _chunk("y", 20, source[20:35], 1.0, 1, **parent)
    (span,), _ = merge_spans([x, y], max_gap_chars=10)
    assert span.text == source[0:35]
    assert len(merge_spans([x, y], max_gap_chars=9)[0]) == 2


def test_cut_at_sentence_and_word_fallback():
    text = "First sentence here. Second one is longer than that. Third."
    assert cut_at_sentence(text, 30) == "First sentence here."
    assert cut_at_sentence(text, len(text)) == text
    assert cut_at_sentence("no sentence end in this long run", 12) == "no sentence"
    assert cut_at_sentence("unbreakable", 5) == ""


def test_citation_text():
    assert citation_text("terms.pdf", ["3. Fees", "3.2 Late payment"], 4, 4) == "[terms.pdf, 3. Fees > 3.2 Late payment, p. 4]"
    assert citation_text("terms.pdf", ["3. Fees"], 3, 4) == "[terms.pdf, 3. Fees, pp. 3-4]"
    assert citation_text("notes.txt", [], None, None) == "[notes.txt]"


def test_page_text_compact():
    assert page_text(4, 4) == "p. 4" and page_text(3, 4) == "pp. 3-4" and page_text(None, None) is None
    assert page_text(4, 4, compact=True) == "p.4" and page_text(3, 4, compact=True) == "pp.3-4"


def _span(doc_id: str, start: int, text: str, path, page: int, name: str, rank: int = 0) -> Span:
    c = Chunk(f"{doc_id}{start}", doc_id, start, start + len(text), text, 1.0 - rank / 10, rank, tuple(path), page, page, name, name)
    return Span(doc_id, c.start, c.end, text, [c], tuple(path))


def test_citation_hints_compact_and_full():
    spans = [
        _span("t", 0, "Late fees are $40.", ("3. Fees", "3.2 Late payment"), 4, "terms.pdf"),
        _span("t", 100, "Returned payments cost $25.", ("3. Fees", "3.3 Returned payment"), 4, "terms.pdf"),
        _span("p", 0, "We keep data for 30 days.", ("Section 4 - Retention",), 1, "privacy.txt"),
        _span("t", 300, "4.1 Limits\n\nYour limit is set by us.", ("4. Limits", "4.1 Limits"), 5, "terms.pdf"),
        _span("t", 400, "Interest is charged daily.", ("5. Interest",), 6, "terms.pdf"),
        _span("t", 500, "5. Interest\n\nRates vary.", ("5. Interest",), 7, "terms.pdf"),
        _span("n", 0, "no pages", (), None, "notes.txt"),
        _span("n", 50, "still no pages", (), None, "notes.txt"),
    ]
    assert citation_hints(spans) == [
        "[terms.pdf, 3. Fees > 3.2 Late payment, p. 4]",
        "[terms.pdf, 3. Fees > 3.3 Returned payment, p. 4]",
        "[privacy.txt, Section 4 - Retention, p. 1]",
        "[terms.pdf, 4. Limits > 4.1 Limits, p. 5]",
        "[terms.pdf, 5. Interest, p. 6]",
        "[terms.pdf, 5. Interest, p. 7]",
        "[notes.txt]",
        "[notes.txt]",
    ]
    assert citation_hints(spans, compact=True) == [
        "[terms.pdf, 3.2 Late payment, p.4]",  # first span: the file, the innermost section, the page
        "[3.3 Returned payment, p.4]",  # same file as the previous span
        "[privacy.txt, Section 4 - Retention, p.1]",  # another file: named again
        "[terms.pdf, p.5]",  # the span starts with its heading "4.1 Limits"
        "[5. Interest, p.6]",
        "[p.7]",  # starts with "5. Interest"
        "[notes.txt]",
        "[notes.txt]",  # never empty
    ]
    assert citation_hints(spans, compact=True, title_words=2)[:3] == [
        "[terms.pdf, 3.2 Late\u2026, p.4]", "[3.3 Returned\u2026, p.4]", "[privacy.txt, Section 4\u2026, p.1]"]


def test_hint_style_from_str_and_validation():
    assert HintStyle.from_str("compact") is HintStyle.COMPACT and HintStyle.from_str(HintStyle.NONE) is HintStyle.NONE
    with pytest.raises(ValueError, match=r"unknown hint style 'short'; allowed: 'full', 'compact', 'none'"):
        ContextAssembler(max_tokens=10, hint_style="short")
    a = ContextAssembler(max_tokens=10, hint_style="full", merge_sections=False)
    assert a.hint_style is HintStyle.FULL and ContextAssembler.from_dict(a.to_dict()).hint_style is HintStyle.FULL
    assert ContextAssembler(max_tokens=10).hint_style is HintStyle.COMPACT  # the benchmark's choice
    assert ContextAssembler(max_tokens=10).merge_sections is True


def test_merge_spans_across_sections_when_asked():
    source = "1. A\n\nOne two three.\n\n2. B\n\nFour five six."
    a = _chunk("a", 0, source[0:21], 0.5, 0, path=("1. A",))
    b = _chunk("b", 21, source[21:], 0.9, 1, path=("2. B",))
    assert len(merge_spans([a, b])[0]) == 2
    (span,), dups = merge_spans([a, b], merge_sections=True)
    assert (span.start, span.end, span.text, dups) == (0, len(source), source, {})
    assert span.section_path == ("2. B",)  # the best chunk's
    c = _chunk("c", 23, source[23:], 0.9, 1, path=("2. B",))  # a gap: never merged without a parent text
    assert len(merge_spans([a, c], merge_sections=True)[0]) == 2


def test_compact_hints_and_section_merge_in_the_assembler():
    parts = ["1. Fees", "Annual fee is due yearly. " * 6, "2. Rates", "Interest accrues daily. " * 6, "3. Limits",
             "Limits are reviewed monthly. " * 6]
    text = "\n\n".join(parts) + "\n"
    doc = Document(text=text, id_="k.txt", metadata={"source": "k.txt", "file_name": "k.txt", "page_starts": [0, 120]})
    nodes = window_parser().get_nodes_from_documents([doc])
    results = [NodeWithScore(node=n, score=1.0 - i / 100) for i, n in enumerate(nodes)]
    count = real_count()
    used = {}
    for style in HintStyle:
        for merge in (False, True):
            a = ContextAssembler(max_tokens=2000, hint_style=style, merge_sections=merge, order="document")
            out = a.postprocess_nodes(results, query_str="fee")
            check_context(out, {doc.id_: doc}, 2000)
            assert "".join(body(r) for r in out) == text  # every character once, in document order
            assert a.last_report.used_tokens == sum(count(llm_text(r)) for r in out)
            used[style, merge] = a.last_report.used_tokens
            if merge:  # the chunks touch across the sections: one span, one hint
                assert len(out) == 1
            else:
                assert len(out) == 3
                if style is HintStyle.COMPACT:  # each span starts with its heading; same file as before
                    assert [r.node.metadata["citation"] for r in out] == ["[k.txt, pp.1-2]", "[p.2]", "[p.2]"]
                if style is HintStyle.FULL:
                    assert [r.node.metadata["citation"] for r in out] == [
                        "[k.txt, 1. Fees, pp. 1-2]", "[k.txt, 2. Rates, p. 2]", "[k.txt, 3. Limits, p. 2]"]
    assert used[HintStyle.NONE, False] < used[HintStyle.COMPACT, False] < used[HintStyle.FULL, False]
    assert used[HintStyle.COMPACT, True] < used[HintStyle.COMPACT, False]


def test_order_spans_bookends_document_relevance():
    spans = [Span("d" if i % 2 else "e", i * 10, i * 10 + 5, "x" * 5, [_chunk(f"c{i}", i * 10, "x" * 5, 1.0 - i / 10, i)]) for i in range(5)]
    spans = [Span(s.doc_id, s.start, s.end, s.text, [Chunk(**{**s.chunks[0].__dict__, "doc_id": s.doc_id})]) for s in spans]
    rel = [s.chunks[0].node_id for s in order_spans(spans, ContextOrder.RELEVANCE)]
    assert rel == ["c0", "c1", "c2", "c3", "c4"]
    assert [s.chunks[0].node_id for s in order_spans(spans, "bookends")] == ["c0", "c2", "c4", "c3", "c1"]
    assert [s.chunks[0].node_id for s in order_spans(spans, "document")] == ["c0", "c2", "c4", "c1", "c3"]


def test_validation_messages():
    with pytest.raises(ValueError, match=r"max_tokens must be an int >= 1, got 0"):
        ContextAssembler(max_tokens=0)
    with pytest.raises(ValueError, match=r"got '512'"):
        ContextAssembler(max_tokens="512")
    with pytest.raises(ValueError, match=r"unknown context order 'middle'; allowed: 'relevance', 'document', 'bookends'"):
        ContextAssembler(max_tokens=10, order="middle")
    with pytest.raises(ValueError, match="tokenizer must be a callable"):
        ContextAssembler(max_tokens=10, tokenizer="cl100k")


def test_round_trip_excludes_tokenizer():
    a = ContextAssembler(max_tokens=300, order="bookends", expand_to_parent=True, tokenizer=str.split)
    data = a.to_dict()
    assert "tokenizer" not in data and "_tokenizer" not in data
    with pytest.raises(ValueError, match="tokenizer="):  # a dict cannot hold the callable: asked for again
        ContextAssembler.from_dict(data)
    b = ContextAssembler.from_dict(data, tokenizer=str.split)
    assert (b.max_tokens, b.order, b.expand_to_parent) == (300, ContextOrder.BOOKENDS, True)
    assert b.to_dict() == data
    assert ContextAssembler.from_json(a.to_json(), tokenizer=str.split).order is ContextOrder.BOOKENDS
    assert ContextAssembler(max_tokens=5).order is ContextOrder.BOOKENDS  # the benchmark's choice


# ------------------------------------------------------------------------------ synthetic documents
WORDS = ["fee", "balance", "payment", "account", "interest", "card", "statement", "dispute", "credit", "rate",
         "monthly", "notice", "merchant", "limit", "cash"]


@st.composite
def documents(draw):
    n_sections = draw(st.integers(1, 3))
    parts = []
    for s in range(n_sections):
        parts.append(f"{s + 1}. Section {WORDS[s]}")
        sentences = draw(st.lists(st.lists(st.sampled_from(WORDS), min_size=3, max_size=14), min_size=2, max_size=10))
        parts.append(" ".join(" ".join(w).capitalize() + "." for w in sentences))
    text = "\n\n".join(parts) + "\n"
    page = draw(st.integers(80, 400))
    return Document(text=text, id_="synthetic.txt", metadata={"source": "synthetic.txt", "file_name": "synthetic.txt",
                                                               "page_starts": list(range(0, len(text), page))})


@functools.lru_cache(maxsize=1)
def window_parser() -> SectionWindowNodeParser:
    return SectionWindowNodeParser(chunk_size=32, chunk_overlap=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    doc=documents(),
    data=st.data(),
    max_tokens=st.integers(1, 300),
    order=st.sampled_from(list(ContextOrder)),
    hint_style=st.sampled_from(list(HintStyle)),
    merge_sections=st.booleans(),
)
def test_synthetic_invariants(doc, data, max_tokens, order, hint_style, merge_sections):
    nodes = window_parser().get_nodes_from_documents([doc])
    picks = data.draw(st.lists(st.integers(0, len(nodes) - 1), min_size=1, max_size=12))
    scores = data.draw(st.lists(st.floats(0, 1), min_size=len(picks), max_size=len(picks)))
    results = [NodeWithScore(node=nodes[i], score=s) for i, s in zip(picks, scores)]
    before = copy.deepcopy(results)
    assembler = ContextAssembler(max_tokens=max_tokens, order=order, hint_style=hint_style, merge_sections=merge_sections)
    out = assembler.postprocess_nodes(results, query_str="fee")
    assert [(r.node.node_id, r.node.text, r.node.metadata, r.score) for r in results] == [
        (r.node.node_id, r.node.text, r.node.metadata, r.score) for r in before
    ]
    check_context(out, {doc.id_: doc}, max_tokens)
    if hint_style is not HintStyle.NONE:
        assert all(r.node.metadata["citation"] for r in out)  # a citation stays visible on every span
    report = assembler.last_report
    covered = {i for r in out for i in r.node.metadata["source_node_ids"]}
    reported = {x.node_id for x in report.left_out}
    assert {nodes[i].node_id for i in picks} <= covered | reported
    assert report.used_tokens <= max_tokens
    if out:
        assert report.used_tokens == sum(real_count()(llm_text(r)) for r in out)


def test_relevance_fill_and_report():
    doc = Document(text="1. Fees\n\n" + " ".join(f"Sentence number {i} talks about fees." for i in range(60)) + "\n",
                   id_="f.txt", metadata={"source": "f.txt", "file_name": "f.txt"})
    nodes = window_parser().get_nodes_from_documents([doc])
    best, worst = nodes[-1], nodes[0]
    results = [NodeWithScore(node=worst, score=0.1), NodeWithScore(node=best, score=0.9)]
    a = ContextAssembler(max_tokens=a_tokens(best) + 2, order="relevance")
    out = a.postprocess_nodes(results, query_str="fees")
    assert [r.node.metadata["source_node_ids"] for r in out] == [[best.node_id]]
    assert a.last_report.left_out[0].node_id == worst.node_id and a.last_report.left_out[0].reason == "over budget"
    # A cut span ends at a sentence boundary.
    a = ContextAssembler(max_tokens=40, min_cut_tokens=8)
    (r,) = a.postprocess_nodes([NodeWithScore(node=best, score=1.0)], query_str="fees")
    assert a.last_report.truncated == [r.node.node_id]
    assert r.node.metadata["truncated"] and body(r).endswith(".")
    check_context([r], {doc.id_: doc}, 40)


def a_tokens(node) -> int:
    hint = citation_text(node.metadata["file_name"], node.metadata["section_path"], 1, 1)
    return real_count()(hint + "\n" + node.text)


def test_scores_of_fused_and_reranked_results_are_kept():
    doc = Document(text="1. Fees\n\n" + " ".join(f"Fee rule {i} applies monthly." for i in range(30)) + "\n",
                   id_="g.txt", metadata={"source": "g.txt", "file_name": "g.txt"})
    nodes = window_parser().get_nodes_from_documents([doc])
    fused = FusedNodeWithScore(node=nodes[0], score=0.7, leg_ranks={"bm25": 1, "dense": 3}, leg_scores={"bm25": 5.0, "dense": 0.4})
    reranked = RerankedNodeWithScore(node=nodes[1], score=0.95, pre_rerank_score=0.3, pre_rerank_rank=2, rerank_logit=3.0)
    out = ContextAssembler(max_tokens=1000).postprocess_nodes([fused, reranked], query_str="fee")
    (r,) = out  # the two windows overlap: one span
    details = r.node.metadata["source_details"]
    assert details[nodes[0].node_id]["leg_ranks"] == {"bm25": 1, "dense": 3}
    assert details[nodes[1].node_id]["rerank_logit"] == 3.0
    assert r.node.metadata["source_scores"] == [0.7, 0.95] and r.score == 0.95
    assert doc.text[r.node.metadata["char_start"] : r.node.metadata["char_end"]] == body(r)


def test_expand_to_parent_and_custom_tokenizer():
    text = "1. Fees\n\n" + " ".join(f"Fee clause {i} is payable on demand." for i in range(40)) + "\n"
    doc = Document(text=text, id_="h.txt", metadata={"source": "h.txt", "file_name": "h.txt"})
    parser = SectionHierarchyNodeParser(parent_chunk_size=128, child_chunk_size=32, child_chunk_overlap=8)
    children = [n for n in parser.get_nodes_from_documents([doc]) if "parent_id" in n.metadata]
    pick = [children[0], children[1], children[-1]]
    results = [NodeWithScore(node=n, score=1.0 - i / 10) for i, n in enumerate(pick)]
    a = ContextAssembler(max_tokens=5000, expand_to_parent=True, tokenizer=lambda s: s.split())
    out = a.postprocess_nodes(results, query_str="fee")
    parents = {(n.metadata["parent_char_start"], n.metadata["parent_char_end"]) for n in pick}
    assert {(r.node.metadata["char_start"], r.node.metadata["char_end"]) for r in out} == parents
    for r in out:
        assert text[r.node.metadata["char_start"] : r.node.metadata["char_end"]] == body(r)
    assert sum(len(llm_text(r).split()) for r in out) <= 5000


# ------------------------------------------------------------------------------ the sample index
@pytest.fixture(scope="module")
def sample_index(tmp_path_factory):
    from llama_index_retrieval_kit.indices import HybridIndex

    template = _support.build_template(tmp_path_factory.mktemp("context_template"))
    path = _support.copy_index(template, tmp_path_factory.mktemp("context") / "index")
    index = HybridIndex.load(path, embed_model=_support.embed_model())
    yield index
    index.close()


def test_sample_index_and_query_engine(sample_index):
    docs = {d.id_: d for d in _support.sample_documents()}
    retriever = sample_index.as_retriever("hybrid", similarity_top_k=12)
    for question in _support.questions()[:6]:
        results = retriever.retrieve(question)
        before = [(r.node.node_id, r.node.text, dict(r.node.metadata)) for r in results]
        for budget in (64, 256, 1024):
            for order in ContextOrder:
                a = ContextAssembler(max_tokens=budget, order=order)
                out = a.postprocess_nodes(results, query_str=question)
                assert out
                check_context(out, docs, budget)
                report = a.last_report
                assert isinstance(report, AssemblyReport) and report.used_tokens <= budget
        assert [(r.node.node_id, r.node.text, dict(r.node.metadata)) for r in results] == before

    assembler = ContextAssembler(max_tokens=256)
    engine = RetrieverQueryEngine.from_args(retriever, llm=MockLLM(), node_postprocessors=[assembler])
    response = engine.query("What is the late payment fee?")
    assert response.source_nodes
    check_context(response.source_nodes, docs, 256)
    assert all(isinstance(r.node, TextNode) and r.node.metadata["citation"] for r in response.source_nodes)
