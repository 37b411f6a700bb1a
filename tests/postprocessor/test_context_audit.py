"""ContextAssembler against issue 12's contract in the cases an audit found broken: a LlamaIndex
tokenizer callable, LlamaIndex's own chunks, two documents under one id or one file name, parent
sections over several pages, the prefix cut, and reports of concurrent queries."""

from __future__ import annotations

import asyncio
import functools
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, List, Sequence

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core.llms import MockLLM
from llama_index.core.node_parser import MarkdownNodeParser, SentenceSplitter
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.core.retrievers import BaseRetriever
from llama_index.core.schema import Document, NodeWithScore, QueryBundle, TextNode
from llama_index.core.utils import get_tokenizer

from llama_index_retrieval_kit import SectionWindowNodeParser, TextFileReader
from llama_index_retrieval_kit.node_parser.metadata import page_of
from llama_index_retrieval_kit.node_parser.section_hierarchy import SectionHierarchyNodeParser
from llama_index_retrieval_kit.postprocessor.context import (
    Chunk,
    ContextAssembler,
    ContextOrder,
    CutMode,
    HintStyle,
    Span,
    citation_hints,
    merge_spans,
    sentence_boundaries,
)

from .test_context import WORDS, body, check_context, documents, llm_text, window_parser


@functools.lru_cache(maxsize=1)
def tiktoken_tokenizer():
    """LlamaIndex's default tokenizer (tiktoken, its encoding bundled with llama_index.core)."""
    return get_tokenizer()


def tiktoken_count(text: str) -> int:
    return len(tiktoken_tokenizer()(text))


@st.composite
def lined_documents(draw):
    """Sections of sentences separated by spaces, line breaks and blank lines, and short table-like
    lines (what PDFs give): whitespace a word-by-word count misses."""
    parts = []
    for s in range(draw(st.integers(1, 3))):
        parts.append(f"{s + 1}. Section {WORDS[s]}\n\n")
        for _ in range(draw(st.integers(2, 10))):
            if draw(st.booleans()):
                words = draw(st.lists(st.sampled_from(WORDS), min_size=3, max_size=14))
                parts.append(" ".join(words).capitalize() + ".")
            else:  # a table row: a word or an amount on a line of its own
                parts.append(draw(st.sampled_from(WORDS + ["$40", "3%", "- $25"])))
            parts.append(draw(st.sampled_from([" ", "\n", "\n\n", "  "])))
        parts.append("\n\n")
    text = "".join(parts)
    page = draw(st.integers(80, 400))
    return Document(text=text, id_="lined.txt", metadata={"source": "lined.txt", "file_name": "lined.txt",
                                                           "page_starts": list(range(0, len(text), page))})


def _results(nodes: Sequence, picks: Sequence[int], scores: Sequence[float]) -> List[NodeWithScore]:
    return [NodeWithScore(node=nodes[i], score=s) for i, s in zip(picks, scores)]


def check_spans(out: Sequence[NodeWithScore], docs: Dict[str, Document]) -> None:
    """Every span sits at its offsets in its document, and no source character comes twice."""
    taken: Dict[str, List[tuple]] = {}
    for r in out:
        meta = r.node.metadata
        start, end = meta["char_start"], meta["char_end"]
        assert start is not None, "a span without offsets"
        assert docs[meta["doc_id"]].text[start:end] == body(r)
        for s, e in taken.get(meta["doc_id"], []):
            assert end <= s or e <= start, f"[{s},{e}) and [{start},{end}) repeat source text"
        taken.setdefault(meta["doc_id"], []).append((start, end))


# ------------------------------------------------------------------------------ F2: tokenizer callables
def test_a_tokenizer_callable_counts_whitespace_and_newlines():
    a = ContextAssembler(max_tokens=100, tokenizer=tiktoken_tokenizer())
    for text in ["[terms.pdf, 1.2 Late Payment Fee, pp.1-2]\n", "The late payment fee is $21 and applies to\naccount type 1.",
                 "Fees:\n\n- $40\n- $25\n- 3%", "Annual\n$95\nLate\n$40\n\n\nForeign\n3%"]:
        assert a.count_tokens(text) == tiktoken_count(text)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    doc=lined_documents(),
    data=st.data(),
    max_tokens=st.integers(1, 300),
    order=st.sampled_from(list(ContextOrder)),
    hint_style=st.sampled_from(list(HintStyle)),
    cut=st.sampled_from(list(CutMode)),
)
def test_the_budget_holds_for_a_llama_index_tokenizer(doc, data, max_tokens, order, hint_style, cut):
    nodes = window_parser().get_nodes_from_documents([doc])
    picks = data.draw(st.lists(st.integers(0, len(nodes) - 1), min_size=1, max_size=12))
    scores = data.draw(st.lists(st.floats(0, 1), min_size=len(picks), max_size=len(picks)))
    a = ContextAssembler(max_tokens=max_tokens, tokenizer=tiktoken_tokenizer(), order=order, hint_style=hint_style, cut=cut)
    out = a.postprocess_nodes(_results(nodes, picks, scores), query_str="fee")
    used = sum(tiktoken_count(llm_text(r)) for r in out)
    assert used <= max_tokens
    assert a.last_report.used_tokens == used
    check_spans(out, {doc.id_: doc})


# ------------------------------------------------------------------------------ F3: LlamaIndex's own chunks
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    doc=lined_documents(),
    data=st.data(),
    chunk_size=st.integers(40, 90),
    overlap=st.integers(5, 30),
    max_tokens=st.integers(40, 800),
)
def test_sentence_splitter_chunks_never_repeat_source_text(doc, data, chunk_size, overlap, max_tokens):
    doc = Document(text=doc.text, id_="s.txt")  # no metadata: SentenceSplitter sizes chunks with it
    nodes = SentenceSplitter(chunk_size=chunk_size, chunk_overlap=overlap).get_nodes_from_documents([doc])
    picks = data.draw(st.lists(st.integers(0, len(nodes) - 1), min_size=1, max_size=12))
    scores = data.draw(st.lists(st.floats(0, 1), min_size=len(picks), max_size=len(picks)))
    a = ContextAssembler(max_tokens=max_tokens, tokenizer=tiktoken_tokenizer())
    out = a.postprocess_nodes(_results(nodes, picks, scores), query_str="fee")
    check_spans(out, {doc.id_: doc})
    assert sum(tiktoken_count(llm_text(r)) for r in out) <= max_tokens


def test_neighbouring_splits_with_a_short_overlap_become_one_span():
    """Found by CI: SentenceSplitter's overlap can be two characters ("2."); LlamaIndex links the
    two splits as PREVIOUS/NEXT, which is the evidence that they are consecutive pieces of one
    text. Without the links, so short an agreement does not splice unchecked offsets."""
    text = ("1. Section fee\n\nfee fee fee fee fee fee fee Fee fee fee. \n\n2. Section balance\n\nfee fee fee "
            "fee Fee fee fee fee fee fee fee fee fee fee fee. fee fee \n\n3. Section payment\n\nfee Fee fee fee. \n\n")
    doc = Document(text=text, id_="s.txt")
    nodes = SentenceSplitter(chunk_size=40, chunk_overlap=5).get_nodes_from_documents([doc])
    first, second = nodes[0], nodes[1]
    assert 0 < first.end_char_idx - second.start_char_idx < 16  # a short overlap, agreeing
    assert second.prev_node.node_id == first.node_id
    a = ContextAssembler(max_tokens=10_000, tokenizer=tiktoken_tokenizer())
    out = a.postprocess_nodes([NodeWithScore(node=first, score=0.5), NodeWithScore(node=second, score=0.4)], query_str="fee")
    assert len(out) == 1
    assert body(out[0]) == text[first.start_char_idx : second.end_char_idx]
    check_spans(out, {doc.id_: doc})

    unlinked = [TextNode(text=n.text, id_=n.node_id, start_char_idx=n.start_char_idx, end_char_idx=n.end_char_idx,
                         relationships={k: v for k, v in n.relationships.items() if k.name == "SOURCE"})
                for n in (first, second)]
    out = a.postprocess_nodes([NodeWithScore(node=n, score=0.5) for n in unlinked], query_str="fee")
    assert [body(r) for r in out] == [first.text, second.text]


def test_chained_llama_index_parsers_are_never_spliced():
    """Markdown sections then SentenceSplitter: LlamaIndex counts start_char_idx in the section, not
    the document; the assembler must not take those for document offsets."""
    text = "\n\n".join(
        f"# Section {i}\n\n" + " ".join(f"Sentence {j} of section {i} says fee {j * i} applies." for j in range(25))
        for i in range(6)
    )
    doc = Document(text=text, id_="md")
    nodes = SentenceSplitter(chunk_size=64, chunk_overlap=16).get_nodes_from_documents(
        MarkdownNodeParser().get_nodes_from_documents([doc])
    )
    assert any(text[n.start_char_idx : n.end_char_idx] != n.text for n in nodes)  # offsets in the section
    out = ContextAssembler(max_tokens=100_000, order="document", hint_style="none").postprocess_nodes(
        [NodeWithScore(node=n, score=1.0) for n in nodes], query_str="fee"
    )
    for r in out:
        assert body(r) in text
        if r.node.metadata["char_start"] is not None:
            assert text[r.node.metadata["char_start"] : r.node.metadata["char_end"]] == body(r)


# ------------------------------------------------------------------------------ F4/F5: one id, one file name
def _chunk(node_id: str, doc_id: str, start: int, text: str, file_path=None, source=None, rank=0) -> Chunk:
    return Chunk(node_id, doc_id, start, start + len(text), text, 1.0, rank, ("A",), 1, 1, "terms.pdf",
                 source, file_path=file_path)


@settings(max_examples=200, deadline=None)
@given(
    texts=st.lists(st.text(alphabet="ab. ", min_size=30, max_size=60), min_size=2, max_size=2),
    windows=st.lists(st.tuples(st.integers(0, 1), st.integers(0, 25), st.integers(3, 25)), min_size=1, max_size=8),
    with_paths=st.booleans(),
)
def test_merged_spans_agree_with_every_chunk(texts, windows, with_paths):
    """Two documents under one id: a span never contradicts a chunk it holds, and with their files
    known, never mixes the two documents."""
    chunks = []
    for k, (which, start, length) in enumerate(windows):
        path = f"/data/{'ab'[which]}/terms.pdf" if with_paths else None
        chunks.append(_chunk(f"n{k}", "terms.pdf", start, texts[which][start : start + length], path, rank=k))
    for merge_sections in (False, True):
        spans, _ = merge_spans(chunks, merge_sections=merge_sections)
        for span in spans:
            for c in span.chunks:
                assert span.text[c.start - span.start : c.end - span.start] == c.text
            if with_paths:
                assert len({c.file_path for c in span.chunks}) == 1
                which = "ab".index(span.chunks[0].file_path.split("/")[2])
                assert texts[which][span.start : span.end] == span.text


def _terms(folder, variant: str):
    folder.mkdir()
    text = (
        f"1. Fees{variant}\n\n"
        + " ".join(f"Clause {i} says the late payment fee is waived after {i} months." for i in range(20))
        + "\n\n2. Rates\n\n" + " ".join(f"Rate rule {i} applies to cash advances." for i in range(20)) + "\n"
    )
    (folder / "terms.txt").write_text(text, encoding="utf-8")
    return folder / "terms.txt"


def test_two_files_under_one_id_are_never_spliced(tmp_path):
    paths = [_terms(tmp_path / "a", ""), _terms(tmp_path / "b", " (Gold card)")]
    docs = [TextFileReader().load_data(p)[0] for p in paths]  # one call each: both ids are "terms.txt"
    assert docs[0].doc_id == docs[1].doc_id == "terms.txt"
    parser = SectionWindowNodeParser(chunk_size=48, chunk_overlap=12)
    nodes = [n for d in docs for n in parser.get_nodes_from_documents([d])]
    results = [NodeWithScore(node=n, score=1.0 - i / 1000) for i, n in enumerate(nodes)]
    by_path = {d.metadata["file_path"]: d for d in docs}
    for style in HintStyle:
        out = ContextAssembler(max_tokens=100_000, order="relevance", hint_style=style).postprocess_nodes(results)
        for r in out:
            meta = r.node.metadata
            assert by_path[meta["file_path"]].text[meta["char_start"] : meta["char_end"]] == body(r)
        assert len({r.node.node_id for r in out}) == len(out)
        if style is not HintStyle.NONE:  # each file's first span names it, apart from the other
            names = {r.node.metadata["file_path"]: r.node.metadata["citation"] for r in reversed(out)}
            assert sorted(names.values())[0].startswith("[a/terms.txt") and sorted(names.values())[1].startswith("[b/terms.txt")


def _span(doc_id: str, start: int, text: str, name: str, source=None, file_path=None) -> Span:
    c = Chunk(f"{doc_id}{start}{file_path}", doc_id, start, start + len(text), text, 1.0, 0, ("1. Fees",), 2, 2, name,
              source, file_path=file_path)
    return Span(doc_id, c.start, c.end, text, [c], c.section_path)


def test_compact_hints_tell_documents_of_one_file_name_apart():
    a = _span("terms.pdf", 0, "Late fees are $40.", "terms.pdf", "pdf_a/terms.pdf", "/x/pdf_a/terms.pdf")
    b = _span("terms.pdf", 0, "Late fees are $45.", "terms.pdf", "pdf_b/terms.pdf", "/x/pdf_b/terms.pdf")
    assert citation_hints([a, b], compact=True) == ["[pdf_a/terms.pdf, 1. Fees, p.2]", "[pdf_b/terms.pdf, 1. Fees, p.2]"]
    assert citation_hints([a, b]) == ["[pdf_a/terms.pdf, 1. Fees, p. 2]", "[pdf_b/terms.pdf, 1. Fees, p. 2]"]
    # no paths: the doc ids tell them apart; one document alone keeps its plain name
    c = _span("2023/terms.pdf", 0, "Late fees are $40.", "terms.pdf")
    d = _span("2024/terms.pdf", 0, "Late fees are $45.", "terms.pdf")
    assert citation_hints([c, d], compact=True) == ["[2023/terms.pdf, 1. Fees, p.2]", "[2024/terms.pdf, 1. Fees, p.2]"]
    assert citation_hints([c], compact=True) == ["[terms.pdf, 1. Fees, p.2]"]
    # the same document twice in a row: named once
    e = _span("2023/terms.pdf", 100, "Rates vary.", "terms.pdf")
    assert citation_hints([c, e], compact=True) == ["[terms.pdf, 1. Fees, p.2]", "[1. Fees, p.2]"]


# ------------------------------------------------------------------------------ F6: parent pages
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=documents(), data=st.data())
def test_expanded_children_cite_their_parents_pages(doc, data):
    parser = SectionHierarchyNodeParser(parent_chunk_size=256, child_chunk_size=24, child_chunk_overlap=6)
    children = [n for n in parser.get_nodes_from_documents([doc]) if "parent_id" in n.metadata]
    page_starts = doc.metadata["page_starts"]
    for n in children:
        m = n.metadata
        assert (m["parent_page_start"], m["parent_page_end"]) == (
            page_of(page_starts, m["parent_char_start"]), page_of(page_starts, m["parent_char_end"] - 1))
        assert "parent_page_start" not in n.get_content(metadata_mode="llm")
        assert "parent_page_start" not in n.get_content(metadata_mode="embed")
    picks = data.draw(st.lists(st.integers(0, len(children) - 1), min_size=1, max_size=6))
    out = ContextAssembler(max_tokens=100_000, expand_to_parent=True).postprocess_nodes(
        [NodeWithScore(node=children[i], score=1.0 - k / 10) for k, i in enumerate(picks)], query_str="fee")
    check_context(out, {doc.id_: doc}, 100_000)  # pages of an untruncated span: exactly those of its text


def test_children_without_parent_pages_keep_their_own():
    text = "1. Fees\n\n" + " ".join(f"Fee clause {i} is payable on demand." for i in range(40)) + "\n"
    doc = Document(text=text, id_="h.txt", metadata={"source": "h.txt", "file_name": "h.txt", "page_starts": [0, 500, 1000]})
    parser = SectionHierarchyNodeParser(parent_chunk_size=1024, child_chunk_size=32, child_chunk_overlap=8)
    child = next(n for n in parser.get_nodes_from_documents([doc]) if "parent_id" in n.metadata)
    older = TextNode(id_=child.node_id, text=child.text, metadata={
        k: v for k, v in child.metadata.items() if k not in ("parent_page_start", "parent_page_end")})
    (r,) = ContextAssembler(max_tokens=100_000, expand_to_parent=True).postprocess_nodes([NodeWithScore(node=older, score=1.0)])
    assert (r.node.metadata["page_start"], r.node.metadata["page_end"]) == (1, 1)
    (r,) = ContextAssembler(max_tokens=100_000, expand_to_parent=True).postprocess_nodes([NodeWithScore(node=child, score=1.0)])
    assert (r.node.metadata["page_start"], r.node.metadata["page_end"]) == (1, 3)


def test_a_cut_span_cites_the_pages_of_its_own_text():
    """A chunk or parent over pages 1-3 cut by the budget to text on page 1 cites p.1, not pp.1-3
    (the chunks' ``page_breaks`` / ``parent_page_breaks``)."""
    text = "1. Fees\n\n" + " ".join(f"Fee clause {i} is payable on demand." for i in range(40)) + "\n"
    doc = Document(text=text, id_="h.txt", metadata={"source": "h.txt", "file_name": "h.txt", "page_starts": [0, 500, 1000]})
    parser = SectionHierarchyNodeParser(parent_chunk_size=1024, child_chunk_size=32, child_chunk_overlap=8)
    nodes = parser.get_nodes_from_documents([doc])
    child = next(n for n in nodes if "parent_id" in n.metadata)
    parent = next(n for n in nodes if n.node_id == child.metadata["parent_id"])
    assert parent.metadata["page_breaks"] == [500, 1000] and child.metadata["parent_page_breaks"] == [500, 1000]
    assert "page_breaks" not in parent.get_content(metadata_mode="llm") + parent.get_content(metadata_mode="embed")
    for node, expand in ((parent, False), (child, True)):
        a = ContextAssembler(max_tokens=40, expand_to_parent=expand, cut="prefix")
        (r,) = a.postprocess_nodes([NodeWithScore(node=node, score=1.0)], query_str="fee clause")
        meta = r.node.metadata
        assert meta["truncated"] and meta["char_end"] <= 500
        assert (meta["page_start"], meta["page_end"]) == (1, 1) and meta["citation"].endswith("p.1]")


# ------------------------------------------------------------------------------ F7: the prefix cut
def test_a_cut_after_short_lines_still_ends_at_a_sentence():
    rows = "".join(f"{w}\n" for w in ["Fee", "Annual", "$95", "Late", "$40", "Foreign", "3%", "Cash", "5%", "Returned",
                                       "$35", "Overlimit", "none", "Copy", "$5", "Stop", "$30", "Wire", "$25"])
    prose = ("The late payment fee applies when the minimum payment is not received by the due date. "
             "It is waived once per year for accounts in good standing for more than twelve months. "
             "Foreign transaction fees apply to purchases made in a currency other than US dollars. "
             "Cash advance fees apply to ATM withdrawals and convenience checks.")
    text = rows + prose
    node = TextNode(text=text, id_="rows", metadata={"doc_id": "t", "char_start": 0, "char_end": len(text)})
    kept = text[: text.index("twelve months.") + len("twelve months.")]
    budget = ContextAssembler(max_tokens=1).count_tokens(kept) + 4  # less than the next sentence
    for cut in CutMode:
        a = ContextAssembler(max_tokens=budget, include_hint=False, cut=cut)
        (r,) = a.postprocess_nodes([NodeWithScore(node=node, score=1.0)], query_str="annual fee")
        assert r.node.text == kept


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(doc=lined_documents(), max_tokens=st.integers(4, 120), min_cut=st.integers(1, 30))
def test_the_prefix_cut_is_the_longest_sentence_prefix_that_fits(doc, max_tokens, min_cut):
    text = doc.text.rstrip()
    node = TextNode(text=text, id_="x", metadata={"doc_id": "x", "char_start": 0, "char_end": len(text)})
    a = ContextAssembler(max_tokens=max_tokens, include_hint=False, cut="prefix", min_cut_tokens=min_cut, tokenizer=str.split)
    out = a.postprocess_nodes([NodeWithScore(node=node, score=1.0)])
    fitting = [text[:b].rstrip() for b in sentence_boundaries(text) if 0 < b and len(text[:b].split()) <= max_tokens]
    if len(text.split()) <= max_tokens:
        assert [r.node.text for r in out] == [text]
    elif fitting and len(max(fitting, key=len).split()) >= min_cut:
        assert [r.node.text for r in out] == [max(fitting, key=len)]
    for r in out:
        assert len(r.node.text.split()) >= min(min_cut, len(text.split())) and len(r.node.text.split()) <= max_tokens


# ------------------------------------------------------------------------------ F8: concurrent queries
class _PerQueryRetriever(BaseRetriever):
    """Query "... k" retrieves chunks of document k only."""

    def _retrieve(self, query_bundle: QueryBundle) -> List[NodeWithScore]:
        k = int(query_bundle.query_str.split()[-1])
        return [
            NodeWithScore(node=TextNode(text=f"Query {k} passage {i}. " + "The fee is waived after months. " * (1 + i % 5),
                                        id_=f"q{k}-n{i}", metadata={"doc_id": f"doc{k}"}), score=1.0 / (i + 1))
            for i in range(3 + k % 7)
        ]


def _describes(k: int, report) -> bool:
    ids = {x.node_id for x in report.left_out} | set(report.merged_into)
    return bool(ids) and all(i.startswith(f"q{k}-") for i in ids)


class _SlowMockLLM(MockLLM):
    """Answers take a little while, so that concurrent queries interleave."""

    def complete(self, prompt, formatted=False, **kwargs):
        import time

        time.sleep(0.005)
        return super().complete(prompt, formatted=formatted, **kwargs)

    async def acomplete(self, prompt, formatted=False, **kwargs):
        await asyncio.sleep(0.005)
        return super().complete(prompt, formatted=formatted, **kwargs)


def test_last_report_is_the_callers_own_under_concurrent_queries():
    assembler = ContextAssembler(max_tokens=120)
    engine = RetrieverQueryEngine.from_args(_PerQueryRetriever(), llm=_SlowMockLLM(max_tokens=8),
                                            node_postprocessors=[assembler])

    def query(k: int) -> bool:
        engine.query(f"when is the fee waived {k}")
        return _describes(k, assembler.last_report)

    with ThreadPoolExecutor(4) as pool:
        assert all(pool.map(query, range(24)))

    async def aquery(k: int) -> bool:
        await engine.aquery(f"when is the fee waived {k}")
        return _describes(k, assembler.last_report)

    async def many() -> List[bool]:
        return await asyncio.gather(*(aquery(k) for k in range(24)))

    assert all(asyncio.run(many()))
    # a reader that ran no query sees the assembler's last call, and assemble() hands each call its own
    seen: List = []
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: seen.append(assembler.last_report)).result()
    assert seen[0] is not None
    nodes = _PerQueryRetriever().retrieve("x 5")
    out, report = assembler.assemble(nodes, "x 5")
    assert _describes(5, report) and re.match(r"\[doc5", llm_text(out[0]))
