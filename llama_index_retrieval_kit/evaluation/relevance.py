"""Relevance judgments that survive re-chunking.

Chunk ids change whenever the chunker or its settings change, so labels are kept at two
levels that do not depend on chunking:

* **documents**: map each retrieved chunk to its document and score the doc ranking against
  doc-level qrels (:func:`doc_level_run`);
* **passages**: keep the reference passage *text* and compare it with the retrieved chunks'
  text (:func:`text_match` for "this chunk holds the passage", :func:`coverage_at_k` for
  "how much of the passage the top-k chunks hold together").

Text comparisons are case-insensitive and ignore whitespace differences (see each function).
All functions are pure.
"""

from __future__ import annotations

import logging
import math
import numbers
from typing import Mapping, Sequence

from rapidfuzz import fuzz
from rapidfuzz.distance import LCSseq

from .metrics import Ranking, parse_ranking

#: How a retrieved chunk is judged relevant: ``"doc"`` (its document id), ``"text"`` (it contains a
#: reference passage), ``"node"`` (its node id), or ``"auto"`` (from what the dataset has).
RELEVANCE_MODES: tuple[str, ...] = ("auto", "doc", "node", "text")

logger = logging.getLogger(__name__)

#: Default for :func:`coverage_at_k`: shortest shared run of characters credited anywhere.
DEFAULT_MIN_MATCH_CHARS = 20
#: Shortest piece of a passage credited where a chunk boundary cuts it (see coverage_at_k).
MIN_CUT_PIECE_CHARS = 3


def doc_level_run(chunk_run: Ranking, chunk_to_doc: Mapping[str, str]) -> list[str] | list[tuple[str, float]]:
    """A ranked chunk list turned into a ranked document list.

    ``chunk_run`` holds chunk ids best first, bare or as ``(chunk_id, score)`` pairs; the result
    has the same form with doc ids. With scores, each document takes the maximum score of its
    chunks (max-score aggregation, MaxP) and the documents are ordered by it, highest first,
    ties keeping the order of their first chunks (a stable sort); so a chunk list that is not
    sorted by score still gives the documents in relevance order. Bare ids: each document
    takes the rank of its first (best-ranked) chunk. Raises ValueError when a chunk id has no
    entry in ``chunk_to_doc``.
    """
    chunk_ids, scores = parse_ranking(chunk_run, "chunk_run")
    if not isinstance(chunk_to_doc, Mapping):
        raise ValueError(f"chunk_to_doc must be a dict chunk_id -> doc_id, got {type(chunk_to_doc).__name__}")
    doc_scores: dict[str, float | None] = {}
    for position, chunk_id in enumerate(chunk_ids):
        if chunk_id not in chunk_to_doc:
            raise ValueError(f"chunk_run[{position}]: chunk id {chunk_id!r} has no document in chunk_to_doc")
        doc_id = chunk_to_doc[chunk_id]
        if not isinstance(doc_id, str):
            raise ValueError(f"chunk_to_doc[{chunk_id!r}] must be a doc id (str), got {doc_id!r}")
        score = scores[position] if scores is not None else None
        if doc_id not in doc_scores:
            doc_scores[doc_id] = score
        elif score is not None:
            doc_scores[doc_id] = max(doc_scores[doc_id], score)  # type: ignore[type-var]
    if scores is None:
        return list(doc_scores)
    by_score = sorted(doc_scores.items(), key=lambda item: -item[1])  # type: ignore[operator]  # stable: ties keep first occurrence
    return [(doc_id, score) for doc_id, score in by_score]  # type: ignore[misc]


# --------------------------------------------------------------------------------------------
# Passage text
# --------------------------------------------------------------------------------------------


def normalize_text(text: str) -> str:
    """``text`` case-folded with each whitespace run turned into one space, ends stripped."""
    return " ".join(text.split()).casefold()


def _squash(text: str) -> str:
    """``text`` case-folded with all whitespace removed (what coverage compares)."""
    return "".join(text.split()).casefold()


def _is_number(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_text(value: object, name: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {type(value).__name__}")
    return value


def _check_chunks(chunks: Sequence[str], name: str = "chunks_topk") -> list[str]:
    if isinstance(chunks, str) or not isinstance(chunks, Sequence):
        raise ValueError(f"{name} must be a list of chunk texts, got {type(chunks).__name__}")
    return [_check_text(chunk, f"{name}[{position}]") for position, chunk in enumerate(chunks)]


def text_match(reference: str, chunk: str, min_similarity: float = 0.9, min_length_ratio: float = 0.95) -> bool:
    """True when ``chunk`` holds the ``reference`` passage.

    Both texts are normalised (:func:`normalize_text`). The chunk matches when it contains the
    reference, or - to tolerate small extraction differences - when rapidfuzz
    ``fuzz.partial_ratio`` (best-aligned similarity, 0-100) is >= ``min_similarity * 100`` and
    the chunk is at least ``min_length_ratio`` times as long as the reference (so a short
    fragment of the passage does not count as the passage). A reference split over two chunks
    matches neither; use :func:`coverage_at_k` for that.
    """
    _check_text(reference, "reference")
    _check_text(chunk, "chunk")
    if not _is_number(min_similarity) or not 0.0 < min_similarity <= 1.0:
        raise ValueError(f"min_similarity must be a number in (0, 1], got {min_similarity!r}")
    if not _is_number(min_length_ratio) or not 0.0 <= min_length_ratio <= 1.0:
        raise ValueError(f"min_length_ratio must be a number in [0, 1], got {min_length_ratio!r}")
    ref = normalize_text(reference)
    if not ref:
        raise ValueError("reference is empty (or only whitespace)")
    text = normalize_text(chunk)
    if ref in text:
        return True
    if len(text) < min_length_ratio * len(ref):
        return False
    if not _may_be_similar(ref, text, min_similarity):
        return False
    return fuzz.partial_ratio(ref, text, score_cutoff=min_similarity * 100.0) >= min_similarity * 100.0


def _may_be_similar(ref: str, text: str, min_similarity: float) -> bool:
    """False when ``partial_ratio(ref, text)`` cannot reach ``min_similarity`` (a fast, exact bound).

    partial_ratio is 2 * LCS(a, w) / (len(a) + len(w)) for the shorter text ``a`` and the best
    window ``w`` of the other; reaching ``s`` needs LCS(a, w) >= s / (2 - s) * len(a), and the
    LCS with the whole text is at least that. Unrelated chunks fail this in microseconds.
    """
    needed = math.floor(min_similarity / (2.0 - min_similarity) * min(len(ref), len(text)))
    return LCSseq.similarity(ref, text) >= needed


def _head_overlap(ref: str, chunk: str) -> int:
    """Length of the longest start of ``ref`` that ends ``chunk`` (0 when none)."""
    position = chunk.find(ref[0], max(0, len(chunk) - len(ref)))
    while position != -1:
        if ref.startswith(chunk[position:]):
            return len(chunk) - position
        position = chunk.find(ref[0], position + 1)
    return 0


def _cut_pieces(ref: str, chunk: str, min_chars: int) -> list[tuple[int, int]]:
    """Spans ``[start, end)`` of ``ref`` that ``chunk`` holds exactly up to one of its ends.

    These are the pieces a chunk boundary leaves: the passage's start at the chunk's end, the
    passage's end at the chunk's start, and a chunk lying wholly inside the passage.
    """
    spans: list[tuple[int, int]] = []
    if not chunk:
        return spans
    head = _head_overlap(ref, chunk)
    if head >= min_chars:
        spans.append((0, head))
    tail = _head_overlap(ref[::-1], chunk[::-1])
    if tail >= min_chars:
        spans.append((len(ref) - tail, len(ref)))
    if len(chunk) >= min_chars:
        start = ref.find(chunk)
        while start != -1:
            spans.append((start, start + len(chunk)))
            start = ref.find(chunk, start + 1)
    return spans


def coverage_at_k(
    reference: str, chunks_topk: Sequence[str], min_match_chars: int = DEFAULT_MIN_MATCH_CHARS
) -> float:
    """Share (0.0-1.0) of the ``reference`` passage found in the top-k chunks taken together.

    Texts are compared case-folded with all whitespace removed, and the share counts the
    passage's non-whitespace characters, so how the chunker cut or re-spaced the text does
    not matter. A passage character is covered when it lies in

    * a run of at least ``min_match_chars`` consecutive characters that also occurs in one of
      the chunks (small extraction differences only break runs, they do not lose whole
      chunks; shared phrases of that length, e.g. repeated product names, are credited too), or
    * a piece that a chunk boundary cut off: the passage's start at a chunk's end, its end at a
      chunk's start, or a whole chunk inside it - at least ``MIN_CUT_PIECE_CHARS`` long, so a
      few letters shared by coincidence are not credited.

    So a passage split over two chunks has coverage 1.0 over both, whatever the split point.
    An empty chunk list gives 0.0; ``chunks_topk`` is the caller's top-k (pass ``chunks[:k]``).
    """
    _check_text(reference, "reference")
    chunks = _check_chunks(chunks_topk)
    if isinstance(min_match_chars, bool) or not isinstance(min_match_chars, int) or min_match_chars < 1:
        raise ValueError(f"min_match_chars must be an int >= 1, got {min_match_chars!r}")
    ref = _squash(reference)
    if not ref:
        raise ValueError("reference is empty (or only whitespace)")

    run_length = min(min_match_chars, len(ref))
    piece_length = min(MIN_CUT_PIECE_CHARS, len(ref))
    covered = bytearray(len(ref))
    runs: set[str] = set()
    for chunk in chunks:
        text = _squash(chunk)
        runs.update(text[i : i + run_length] for i in range(len(text) - run_length + 1))
        for start, end in _cut_pieces(ref, text, piece_length):
            covered[start:end] = b"\x01" * (end - start)
    for start in range(len(ref) - run_length + 1):
        if ref[start : start + run_length] in runs:
            covered[start : start + run_length] = b"\x01" * run_length
    return sum(covered) / len(ref)


def chars_at_k(chunks_topk: Sequence[str]) -> int:
    """Total characters in the top-k chunks: the context a generator would have to read."""
    return sum(len(chunk) for chunk in _check_chunks(chunks_topk))
