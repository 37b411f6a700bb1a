"""ContextAssembler's query-focused cut (``cut="query"``): sentence pieces, the best run, the assembler."""

from __future__ import annotations

import copy
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llama_index.core.schema import Document, NodeWithScore

from llama_index_retrieval_kit import SectionWindowNodeParser
from llama_index_retrieval_kit.postprocessor.context import (
    Chunk,
    ContextAssembler,
    ContextOrder,
    CutMode,
    HintStyle,
    Span,
    best_run,
    chunk_pieces,
    citation_hints,
    query_idf,
    sentence_pieces,
)

from .test_context import WORDS, body, check_context, documents, llm_text, real_count, window_parser


# ------------------------------------------------------------------------------ pure functions
@given(st.text(alphabet=st.sampled_from(list("ab .!?\n\t\"')")), max_size=80))
def test_sentence_pieces_tile_the_text(text):
    pieces = sentence_pieces(text)
    assert "".join(text[s:e] for s, e in pieces) == text
    assert all(s < e for s, e in pieces)
    assert [s for s, _ in pieces[1:]] == [e for _, e in pieces[:-1]]
    for s, _ in pieces[1:]:  # a later piece starts a sentence: at a non-space after a sentence end or a line end
        assert not text[s].isspace()
        before = text[:s].rstrip()
        assert re.search(r"[.!?][\"')]*$", before) or "\n" in text[len(before) : s]


def test_sentence_pieces_examples():
    text = "1. Fees\n\nLate fees are $40. Returned payments cost $25! Really?  Yes.\n"
    assert [text[s:e] for s, e in sentence_pieces(text)] == [
        "1. ", "Fees\n\n", "Late fees are $40. ", "Returned payments cost $25! ", "Really?  ", "Yes.\n"]
    assert sentence_pieces("") == [] and sentence_pieces("no end") == [(0, 6)]


def test_chunk_pieces_are_exact():
    source = "Intro. Alpha beta. Gamma delta!\nEpsilon."
    c = Chunk("n", "d", 7, len(source), source[7:], 0.5, 0, ("A",), 1, 2, "d.txt")
    pieces = chunk_pieces(c)
    assert [p.text for p in pieces] == ["Alpha beta. ", "Gamma delta!\n", "Epsilon."]
    for p in pieces:
        assert source[p.start : p.end] == p.text and p.node_id == "n" and (p.page_start, p.page_end) == (1, 2)
    no_offsets = Chunk("m", "d", None, None, "One. Two.", 0.5, 0)
    assert chunk_pieces(no_offsets) == [no_offsets]


def test_query_idf():
    idf = query_idf(["fee", "card", "fee"], [["fee", "late"], ["card"], ["card", "fee"], []])
    assert set(idf) == {"fee", "card"}
    assert idf["fee"] == pytest.approx(idf["card"]) and idf["fee"] > 0
    rare = query_idf(["x", "y"], [["x"], ["y"], ["y"], ["y"]])
    assert rare["x"] > rare["y"] > 0


@settings(max_examples=200, deadline=None)
@given(
    data=st.data(),
    n=st.integers(1, 9),
    cap=st.integers(0, 40),
    min_len=st.integers(0, 12),
)
def test_best_run_is_the_heaviest_run_that_fits(data, n, cap, min_len):
    vocab = ["a", "b", "c", "d"]
    lengths = data.draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    terms = data.draw(st.lists(st.frozensets(st.sampled_from(vocab), max_size=2), min_size=n, max_size=n))
    weights = dict(zip(vocab, data.draw(st.lists(st.floats(0.01, 5), min_size=4, max_size=4))))
    fits = lambda i, j: sum(lengths[i : j + 1]) <= cap  # noqa: E731 - monotone in both ends
    keep = lambda i, j: sum(lengths[i : j + 1]) >= min_len  # noqa: E731

    def weight(i, j):
        return sum(weights[t] for t in frozenset().union(*terms[i : j + 1]))

    found = best_run(weights, terms, fits, keep)
    candidates = [(i, j) for i in range(n) for j in range(i, n) if fits(i, j) and keep(i, j) and (i == 0 or terms[i])]
    best = max((weight(i, j) for i, j in candidates), default=0.0)
    if best <= 0:
        assert found is None
        return
    assert found is not None
    i, j = found
    assert fits(i, j) and keep(i, j) and weight(i, j) == pytest.approx(best)
    assert all(weight(k, m) < best - 1e-9 for k, m in candidates if k < i)  # ties: the earliest start


def test_best_run_examples():
    terms = [frozenset(), frozenset({"fee"}), frozenset(), frozenset({"late", "fee"})]
    weights = {"fee": 1.0, "late": 2.0}
    assert best_run(weights, terms, lambda i, j: True) == (0, 3)  # everything fits: the whole chunk
    assert best_run(weights, terms, lambda i, j: j - i < 2) == (3, 3)  # two pieces at most: "late" weighs most
    assert best_run(weights, terms, lambda i, j: False) is None
    assert best_run(weights, [frozenset(), frozenset()], lambda i, j: True) is None  # nothing matches
    # Equal term sets reached in another order weigh exactly the same: the earliest start wins
    # (hypothesis found sums that differed in the last bit).
    terms = [frozenset()] * 4 + [frozenset("b"), frozenset("ab"), frozenset("c"), frozenset("d")]
    weights = dict(zip("abcd", [1.0, 1.2912953219129522, 1.6222623295504426, 2.291295321912952]))
    assert best_run(weights, terms, lambda i, j: j - i < 4) == (4, 7)


# ------------------------------------------------------------------------------ compact hints
def _span(doc_id, start, text, path, page=1, name="m.md"):
    c = Chunk(f"{doc_id}{start}", doc_id, start, start + len(text), text, 1.0, 0, tuple(path), page, page, name, name)
    return Span(doc_id, c.start, c.end, text, [c], tuple(path))


def test_compact_hints_markdown_headings_wrapped_and_long_titles():
    manual = "Water Filter Manual"
    wrapped = "Mosaic PPM1D mutations are associated\nwith predisposition to breast and ovarian\ncancer"
    spans = [
        _span("m", 0, "## Filter Indicator Light\n\nA small light.", (manual, "Filter Indicator Light")),
        _span("m", 500, "Press and hold the reset button.", (manual, "Filter Replacement", "How to Replace")),
        _span("s", 0, "Mosaic PPM1D mutations are associated with\npredisposition to breast and ovarian cancer.\n\nAbstract.",
              ("Part 1", wrapped), page=2, name="s.pdf"),
        _span("s", 900, "Truncating mutations were found.", ("Part 1", wrapped), page=3, name="s.pdf"),
    ]
    assert citation_hints(spans, compact=True, title_words=6) == [
        "[m.md, p.1]",  # the span starts with its Markdown heading
        "[How to Replace, p.1]",  # the innermost section only
        "[s.pdf, p.2]",  # starts with its heading, wrapped differently
        "[Mosaic PPM1D mutations are associated with\u2026, p.3]",  # a long title: its first 6 words
    ]
    assert citation_hints(spans)[1] == f"[m.md, {manual} > Filter Replacement > How to Replace, p. 1]"
    assert citation_hints(spans)[3] == f"[s.pdf, Part 1 > {' '.join(wrapped.split())}, p. 3]"  # one line


# ------------------------------------------------------------------------------ the assembler
def _doc() -> Document:
    filler = " ".join(f"Clause {i} covers the monthly statement in plain words." for i in range(12))
    text = (
        "1. Statements\n\n" + filler + "\n\n2. Replacement\n\n"
        + " ".join(f"Step {i} describes the billing cycle for your account." for i in range(6))
        + " Press and hold the zeolite reset button for five seconds. "
        + " ".join(f"Note {i} repeats the billing cycle wording." for i in range(3)) + "\n"
    )
    return Document(text=text, id_="z.txt", metadata={"source": "z.txt", "file_name": "z.txt", "page_starts": [0, 400]})


def test_query_cut_keeps_the_matching_sentences():
    doc = _doc()
    nodes = SectionWindowNodeParser(chunk_size=64, chunk_overlap=8).get_nodes_from_documents([doc])
    holder = next(n for n in nodes if "zeolite" in n.text)
    first = nodes[0]
    assert "zeolite" not in first.text and holder.text.startswith("describes")  # a window starting mid-sentence
    results = [NodeWithScore(node=first, score=0.9), NodeWithScore(node=holder, score=0.8)]
    query = "How do I reset the zeolite filter?"
    count = real_count()
    # Room for the first chunk whole, a hint and about one sentence of the second.
    sentence = "Press and hold the zeolite reset button for five seconds."
    budget = count(f"[z.txt, 1. Statements, p. 1]\n{first.text}") + count(f"[z.txt, 2. Replacement, p. 2]\n{sentence}") + 4
    outs = {}
    for cut in CutMode:
        a = ContextAssembler(max_tokens=budget, cut=cut, order="relevance", hint_style="full", min_cut_tokens=8)
        outs[cut] = out = a.postprocess_nodes(results, query_str=query)
        check_context(out, {doc.id_: doc}, budget)
        assert [r.node.metadata["source_node_ids"] for r in out] == [[first.node_id], [holder.node_id]]
        assert a.last_report.truncated == [out[1].node.node_id] and not a.last_report.left_out
        assert re.search(r"[.!?]$", body(out[1]))  # the cut ends at a sentence boundary
    assert "zeolite" in body(outs[CutMode.QUERY][1]) and "zeolite" not in body(outs[CutMode.PREFIX][1])
    assert body(outs[CutMode.PREFIX][1]) == holder.text[: len(body(outs[CutMode.PREFIX][1]))]  # a prefix
    # Without a query string there is nothing to match: the prefix cut.
    a = ContextAssembler(max_tokens=budget, order="relevance", hint_style="full", min_cut_tokens=8)
    no_query = a.postprocess_nodes(results)
    assert [llm_text(r) for r in no_query] == [llm_text(r) for r in outs[CutMode.PREFIX]]


def test_cut_mode_validation_and_round_trip():
    assert ContextAssembler(max_tokens=10).cut is CutMode.QUERY  # the benchmark's choice
    with pytest.raises(ValueError, match=r"unknown cut mode 'best'; allowed: 'prefix', 'query'"):
        ContextAssembler(max_tokens=10, cut="best")
    a = ContextAssembler(max_tokens=10, cut="prefix", hint_title_words=3)
    b = ContextAssembler.from_dict(a.to_dict())
    assert (b.cut, b.hint_title_words) == (CutMode.PREFIX, 3)
    assert ContextAssembler(max_tokens=10).hint_title_words == 6
    with pytest.raises(ValueError, match="hint_title_words"):
        ContextAssembler(max_tokens=10, hint_title_words=-1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    doc=documents(),
    data=st.data(),
    max_tokens=st.integers(1, 300),
    order=st.sampled_from(list(ContextOrder)),
    hint_style=st.sampled_from(list(HintStyle)),
    cut=st.sampled_from(list(CutMode)),
    query=st.lists(st.sampled_from(WORDS), min_size=1, max_size=4),
)
def test_query_cut_invariants(doc, data, max_tokens, order, hint_style, cut, query):
    """Never over the budget, exact spans, no repeated character, right pages, every input accounted for."""
    nodes = window_parser().get_nodes_from_documents([doc])
    picks = data.draw(st.lists(st.integers(0, len(nodes) - 1), min_size=1, max_size=12))
    scores = data.draw(st.lists(st.floats(0, 1), min_size=len(picks), max_size=len(picks)))
    results = [NodeWithScore(node=nodes[i], score=s) for i, s in zip(picks, scores)]
    before = copy.deepcopy(results)
    a = ContextAssembler(max_tokens=max_tokens, order=order, hint_style=hint_style, cut=cut)
    out = a.postprocess_nodes(results, query_str=" ".join(query))
    assert [(r.node.node_id, r.node.text, r.node.metadata) for r in results] == [
        (r.node.node_id, r.node.text, r.node.metadata) for r in before
    ]
    check_context(out, {doc.id_: doc}, max_tokens)
    report = a.last_report
    covered = {i for r in out for i in r.node.metadata["source_node_ids"]}
    assert {nodes[i].node_id for i in picks} <= covered | {x.node_id for x in report.left_out}
    assert report.used_tokens == sum(real_count()(llm_text(r)) for r in out) <= max_tokens
    chunk_ends = {n.metadata["char_end"] for n in nodes}
    for r in out:  # a cut ends at a sentence (else word) boundary, or its span at a chunk's end
        end = r.node.metadata["char_end"]
        assert end in chunk_ends or doc.text[end : end + 1].isspace() or end == len(doc.text)
