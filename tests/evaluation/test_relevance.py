"""Chunking-proof relevance: doc-level runs, passage text matching and coverage."""

from __future__ import annotations

import copy

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from llama_index_retrieval_kit.evaluation.relevance import (
    MIN_CUT_PIECE_CHARS,
    chars_at_k,
    coverage_at_k,
    doc_level_run,
    normalize_text,
    text_match,
)

# Distinct sentences, so no 20-character run repeats by accident.
DOCUMENT = (
    "Northwind Bank issues the Everyday Visa to residents of the United States. "
    "The annual fee for the card is $95, waived for the first year your account is open. "
    "If we do not receive at least your minimum payment by the due date, we will charge a late fee of up to $40. "
    "We charge a foreign transaction fee of 3% of the dollar amount of each purchase made abroad. "
    "Cash advances cost the greater of $10 or 5% of the amount withdrawn at an automated teller machine. "
    "You can dispute a charge by writing to us within sixty days of the statement date."
)
REFERENCE = (
    "If we do not receive at least your minimum payment by the due date, we will charge a late fee of up to $40. "
    "We charge a foreign transaction fee of 3% of the dollar amount of each purchase made abroad."
)
REF_START = DOCUMENT.index(REFERENCE)
REF_END = REF_START + len(REFERENCE)


def squashed_length(text: str) -> int:
    return len("".join(text.split()))


def chunk_by_windows(text: str, size: int, overlap: int = 0) -> list[tuple[int, int]]:
    """Fixed character windows ``[start, end)``, like a naive character chunker."""
    spans, start = [], 0
    while start < len(text):
        spans.append((start, min(start + size, len(text))))
        start += size - overlap
    return spans


# --------------------------------------------------------------------------------------------
# doc_level_run
# --------------------------------------------------------------------------------------------

CHUNK_TO_DOC = {"a1": "A", "a2": "A", "b1": "B", "c1": "C"}


def test_doc_level_run_bare_ids_keep_first_occurrence_order() -> None:
    assert doc_level_run(["b1", "a2", "b1", "a1", "c1"], CHUNK_TO_DOC) == ["B", "A", "C"]


def test_doc_level_run_takes_max_score_but_first_occurrence_rank() -> None:
    run = [("a1", 0.9), ("b1", 0.8), ("a2", 0.95), ("c1", 0.1)]
    assert doc_level_run(run, CHUNK_TO_DOC) == [("A", 0.95), ("B", 0.8), ("C", 0.1)]


def test_doc_level_run_edge_cases_and_no_mutation() -> None:
    run = [("a1", 0.9), ("a2", 0.5)]
    run_before, mapping_before = copy.deepcopy(run), copy.deepcopy(CHUNK_TO_DOC)
    assert doc_level_run(run, CHUNK_TO_DOC) == [("A", 0.9)]
    assert run == run_before and CHUNK_TO_DOC == mapping_before
    assert doc_level_run([], CHUNK_TO_DOC) == []


def test_doc_level_run_rejects_unmapped_chunks_and_bad_input() -> None:
    with pytest.raises(ValueError, match=r"chunk_run\[1\]: chunk id 'zz' has no document"):
        doc_level_run(["a1", "zz"], CHUNK_TO_DOC)
    with pytest.raises(ValueError, match=r"chunk_to_doc\['a1'\] must be a doc id"):
        doc_level_run(["a1"], {"a1": 3})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="chunk_to_doc must be a dict"):
        doc_level_run(["a1"], [("a1", "A")])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="a dict has no rank order"):
        doc_level_run({"a1": 0.3}, CHUNK_TO_DOC)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# text_match
# --------------------------------------------------------------------------------------------


def test_text_match_containment_ignores_case_and_whitespace() -> None:
    reference = "If we do not receive your minimum payment by the due date, we will charge a late fee of up to $40."
    chunk = "Intro.  IF WE DO NOT receive your\nminimum payment by the due date, we will\tcharge a late fee of up to $40. More."
    assert text_match(reference, chunk)
    assert normalize_text("  A\n\tB  c ") == "a b c"


def test_text_match_tolerates_small_extraction_differences() -> None:
    reference = "We charge a foreign transaction fee of 3% of the dollar amount of each purchase made abroad."
    extracted = "We charge a for-eign transaction fee of 3 % of the dollar amount of each purchase made abroad."
    assert reference.casefold() not in extracted.casefold()
    assert text_match(reference, "Preamble text. " + extracted + " Trailing text.")
    assert text_match(reference, extracted)


def test_text_match_rejects_fragments_and_unrelated_text() -> None:
    reference = "We charge a foreign transaction fee of 3% of the dollar amount of each purchase made abroad."
    fragment = "foreign transaction fee of 3%"
    assert not text_match(reference, fragment)  # similar but far too short
    assert not text_match(reference, "You can dispute a charge by writing to us within sixty days of the statement date.")
    assert not text_match(reference, "")


def test_text_match_length_ratio_applies_to_near_complete_chunks() -> None:
    reference = "We charge a foreign transaction fee of 3% of the dollar amount of each purchase made abroad."
    almost = reference[:-6]  # 93% of the passage
    assert not text_match(reference, almost)
    assert text_match(reference, almost, min_length_ratio=0.9)


def test_text_match_argument_checks() -> None:
    with pytest.raises(ValueError, match="reference is empty"):
        text_match("  \n", "chunk")
    with pytest.raises(ValueError, match=r"min_similarity must be a number in \(0, 1\], got 90"):
        text_match("a", "a", min_similarity=90)
    with pytest.raises(ValueError, match=r"min_similarity must be a number in \(0, 1\], got '0.9'"):
        text_match("a", "a", min_similarity="0.9")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"min_length_ratio must be a number in \[0, 1\], got -0.1"):
        text_match("a", "a", min_length_ratio=-0.1)
    with pytest.raises(ValueError, match="chunk must be a string, got NoneType"):
        text_match("a", None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# coverage_at_k and chars_at_k
# --------------------------------------------------------------------------------------------


def test_reference_split_over_two_chunks_matches_neither_but_is_fully_covered() -> None:
    middle = REF_START + len(REFERENCE) // 2
    first, second = DOCUMENT[:middle], DOCUMENT[middle:]
    assert not text_match(REFERENCE, first)
    assert not text_match(REFERENCE, second)
    assert coverage_at_k(REFERENCE, [first, second]) == 1.0
    assert coverage_at_k(REFERENCE, [second, first]) == 1.0
    share_first = squashed_length(DOCUMENT[REF_START:middle]) / squashed_length(REFERENCE)
    assert coverage_at_k(REFERENCE, [first]) == pytest.approx(share_first)
    assert coverage_at_k(REFERENCE, [second]) == pytest.approx(1 - share_first)


def test_coverage_is_consistent_across_chunkings_of_the_same_text() -> None:
    """One labelled question, scored against two chunkings (different sizes, one with overlap)."""
    chunking_a = chunk_by_windows(DOCUMENT, 100)  # [0, 100), [100, 200), [200, 300), [300, 400), ...
    chunking_b = chunk_by_windows(DOCUMENT, 150, overlap=50)  # [0, 150), [100, 250), ..., [300, 450), ...
    cut = 300  # both chunkings start a chunk here, inside the reference
    assert REF_START < cut < REF_END
    share_after_cut = squashed_length(DOCUMENT[cut:REF_END]) / squashed_length(REFERENCE)
    for spans in (chunking_a, chunking_b):
        chunks = [DOCUMENT[start:end] for start, end in spans]
        touching = [DOCUMENT[start:end] for start, end in spans if start < REF_END and end > REF_START]
        after_cut = [DOCUMENT[start:end] for start, end in spans if start >= cut]
        assert not any(text_match(REFERENCE, chunk) for chunk in chunks)  # the passage is always split
        assert coverage_at_k(REFERENCE, chunks) == 1.0
        assert coverage_at_k(REFERENCE, touching) == 1.0
        assert coverage_at_k(REFERENCE, after_cut) == pytest.approx(share_after_cut)
    # A chunking with one big chunk holding the passage agrees too, and text_match sees it.
    assert text_match(REFERENCE, DOCUMENT)
    assert coverage_at_k(REFERENCE, [DOCUMENT]) == 1.0


def test_coverage_ignores_unrelated_chunks_and_handles_empty_input() -> None:
    unrelated = [
        "Cash advances cost the greater of $10 or 5% of the amount withdrawn at an automated teller machine.",
        "You can dispute a charge by writing to us within sixty days of the statement date.",
    ]
    assert coverage_at_k(REFERENCE, unrelated) == 0.0
    assert coverage_at_k(REFERENCE, []) == 0.0
    assert coverage_at_k(REFERENCE, [""]) == 0.0


def test_coverage_ignores_case_and_whitespace() -> None:
    chunk = REFERENCE.upper().replace(" ", "\n  ")
    assert coverage_at_k(REFERENCE, [chunk]) == 1.0


def test_coverage_credits_runs_despite_small_differences() -> None:
    extracted = REFERENCE.replace("minimum", "minimurn").replace("foreign", "for-eign")
    coverage = coverage_at_k(REFERENCE, [extracted])
    assert 0.9 < coverage < 1.0


def test_coverage_does_not_credit_cut_pieces_shorter_than_the_minimum() -> None:
    # The chunk ends with the passage's first two letters only: too short to tell from chance.
    reference = "Late fees apply after the due date."
    assert MIN_CUT_PIECE_CHARS == 3
    assert coverage_at_k(reference, ["Something unrelated la"]) == 0.0
    assert coverage_at_k(reference, ["Something unrelated lat"]) == pytest.approx(3 / squashed_length(reference))


def test_coverage_argument_checks() -> None:
    with pytest.raises(ValueError, match="reference is empty"):
        coverage_at_k(" ", ["x"])
    with pytest.raises(ValueError, match="chunks_topk must be a list of chunk texts, got str"):
        coverage_at_k(REFERENCE, "a chunk")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"chunks_topk\[1\] must be a string"):
        coverage_at_k(REFERENCE, ["ok", 3])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="min_match_chars must be an int >= 1, got 0"):
        coverage_at_k(REFERENCE, ["x"], min_match_chars=0)


def test_chars_at_k() -> None:
    assert chars_at_k(["abc", "", "de f"]) == 7
    assert chars_at_k([]) == 0
    with pytest.raises(ValueError, match="chunks_topk must be a list"):
        chars_at_k("abc")  # type: ignore[arg-type]


@settings(max_examples=50, deadline=None, database=None)
@given(
    cuts=st.lists(st.integers(1, len(DOCUMENT) - 1), unique=True, max_size=12),
    order_seed=st.randoms(use_true_random=False),
)
def test_any_chunking_that_holds_the_passage_covers_it_fully(cuts: list[int], order_seed) -> None:
    """Whatever the boundaries and the order of the chunks, coverage of the whole text is 1.0."""
    bounds = [0, *sorted(cuts), len(DOCUMENT)]
    spans = list(zip(bounds, bounds[1:]))
    # By design, a piece of the passage shorter than MIN_CUT_PIECE_CHARS that a chunk holds only
    # up to its boundary is not credited (real chunks are far longer); leave such cuts out.
    pieces = [DOCUMENT[max(start, REF_START) : min(end, REF_END)] for start, end in spans]
    assume(all(squashed_length(piece) >= MIN_CUT_PIECE_CHARS or not piece.strip() for piece in pieces if piece))
    chunks = [DOCUMENT[start:end] for start, end in spans if start < REF_END and end > REF_START]
    order_seed.shuffle(chunks)
    assert coverage_at_k(REFERENCE, chunks) == 1.0
