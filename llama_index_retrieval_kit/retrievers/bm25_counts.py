"""bm25s's score matrix built in arrays, and updated after inserts and deletes without a rebuild.

bm25s builds its index (``BM25.index`` -> ``build_index_from_ids``, the step its docs name as the
one to override) with a Python loop per document: a ``Counter`` of its terms, a set intersection
for document frequencies, then one sort of every entry. At 90k chunks that is about 2 s, paid
again on every update, since ``HybridIndex.upsert`` / ``delete`` rebuild the snapshot.

Here the same matrix comes from arrays:

* :class:`TermCounts`: each (term, document) pair's term frequency, aligned with bm25s's CSC
  matrix (term-major, documents ascending), with each document's length and each matrix column's
  term in the :class:`~.bm25.PackedTokens` vocabulary. Counted from the tokens once
  (:func:`count_terms`, one integer sort), then *updated*: :func:`updated_counts` drops the removed
  documents' entries and merges in the new documents' (only the new tokens are counted);
* :func:`bm25s_scores`: the score matrix of those counts, every value computed with the same
  floating-point operations, in the same dtypes, as bm25s's own loop (``scoring.py``), so the
  matrix is identical bit for bit (tested against ``bm25s.BM25.index`` for every method it
  vectorises: ``lucene``, ``robertson``, ``atire``). Per entry (Kamphuis et al. 2020, as bm25s):
  ``score = idf(df) * tfc(tf, |d|, avgdl)`` with ``tfc = tf / (k1 * ((1 - b) + b * |d| / avgdl) + tf)``
  (lucene, robertson) or ``tf * (k1 + 1) / (tf + k1 * (1 - b + b * |d| / avgdl))`` (atire), and
  ``idf`` lucene ``log(1 + (N - df + 0.5) / (df + 0.5))``, robertson ``log(max(1, (N - df + 0.5) /
  (df + 0.5)))``, atire ``log(N / df)``.

``bm25l`` and ``bm25+`` (with their non-occurrence scores) keep bm25s's own build.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import bm25s
import numpy as np

#: The methods whose matrix :func:`bm25s_scores` builds (the others: bm25s's own loop).
VECTORISED_METHODS = ("lucene", "robertson", "atire")

#: The dtype of ``numpy.float64 scalar (op) float32 array``: bm25s mixes the two per document
#: (float64 under NumPy 2's promotion rules, float32 under NumPy 1's value-based casting).
_MIXED = (np.float64(1.0) + np.ones(1, dtype=np.float32)).dtype

_IDF: Dict[str, Callable[[int, int], float]] = {
    "lucene": lambda df, n: math.log(1 + (n - df + 0.5) / (df + 0.5)),
    "robertson": lambda df, n: math.log(max((n - df + 0.5) / (df + 0.5), 1)),
    "atire": lambda df, n: math.log(n / df),
}


@dataclass(frozen=True)
class TermCounts:
    """Term frequencies of a corpus, aligned with the CSC score matrix bm25s builds for it.

    ``tf[j]`` is the frequency of the ``j``-th matrix entry: column (term) ``c`` holds entries
    ``indptr[c]:indptr[c + 1]``, documents ``rows[...]`` ascending; ``column_terms[c]`` is that
    term's id in the token vocabulary; ``doc_len[d]`` is document ``d``'s number of tokens.
    """

    tf: np.ndarray  # uint16, or int32 when a count exceeds 65535
    rows: np.ndarray  # int32: the document of each entry
    indptr: np.ndarray  # int64, len = number of columns + 1
    column_terms: np.ndarray  # int64: the vocabulary id of each column
    doc_len: np.ndarray  # int64, one per document

    @property
    def n_docs(self) -> int:
        return len(self.doc_len)


def _compact(tf: np.ndarray) -> np.ndarray:
    """``tf`` as uint16 when every count fits (2 bytes per entry kept with the snapshot)."""
    return tf.astype(np.uint16) if len(tf) == 0 or int(tf.max()) <= np.iinfo(np.uint16).max else tf.astype(np.int32)


def _pairs(ids: np.ndarray, offsets: np.ndarray, first_row: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(term, row, tf) of each distinct (term, document) pair, sorted by term then row; rows
    numbered from ``first_row``."""
    n_docs = len(offsets) - 1
    doc_len = np.diff(offsets)
    if len(ids) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    rows = np.repeat(np.arange(n_docs, dtype=np.int64), doc_len)
    keys = ids.astype(np.int64) * max(n_docs, 1) + rows  # term-major: sorted keys are CSC order
    keys.sort()
    starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
    tf = np.diff(np.append(starts, len(keys)))
    unique = keys[starts]
    return unique // max(n_docs, 1), unique % max(n_docs, 1) + first_row, tf


def _assemble(terms: np.ndarray, rows: np.ndarray, tf: np.ndarray, doc_len: np.ndarray) -> TermCounts:
    """TermCounts of entries sorted by (vocabulary term, row)."""
    if len(terms):
        boundaries = np.flatnonzero(terms[1:] != terms[:-1]) + 1
        column_terms = terms[np.concatenate(([0], boundaries))]
        indptr = np.concatenate(([0], boundaries, [len(terms)])).astype(np.int64)
    else:
        column_terms, indptr = np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    return TermCounts(
        tf=_compact(tf), rows=rows.astype(np.int32), indptr=indptr, column_terms=column_terms.astype(np.int64),
        doc_len=doc_len.astype(np.int64),
    )


def count_terms(ids: np.ndarray, offsets: np.ndarray) -> TermCounts:
    """The :class:`TermCounts` of documents whose token ids are ``ids[offsets[d]:offsets[d + 1]]``."""
    terms, rows, tf = _pairs(ids, offsets, 0)
    return _assemble(terms, rows, tf, np.diff(offsets))


def updated_counts(old: TermCounts, kept: Sequence[int], new_ids: np.ndarray, new_offsets: np.ndarray) -> TermCounts:
    """The counts of the documents ``kept`` (ascending positions in ``old``, renumbered 0..) followed
    by new documents (token ids ``new_ids`` split at ``new_offsets``, in the same vocabulary):
    only the new tokens are counted; the kept entries are filtered and merged in one pass."""
    kept_positions = np.asarray(kept, dtype=np.int64)
    if len(kept_positions) > 1 and np.any(np.diff(kept_positions) <= 0):
        raise ValueError("kept positions must be strictly increasing")
    keep_doc = np.zeros(old.n_docs, dtype=bool)
    keep_doc[kept_positions] = True
    new_row = np.full(old.n_docs, -1, dtype=np.int64)
    new_row[kept_positions] = np.arange(len(kept_positions), dtype=np.int64)
    entry_keep = keep_doc[old.rows]
    terms = np.repeat(old.column_terms, np.diff(old.indptr))[entry_keep]
    rows = new_row[old.rows[entry_keep]]
    tf = old.tf[entry_keep].astype(np.int64)
    add_terms, add_rows, add_tf = _pairs(new_ids, new_offsets, len(kept_positions))
    if len(add_terms):
        # Kept entries are sorted by (term, row) and every new row is larger than every kept one:
        # each new entry goes after the kept entries of its term.
        at = np.searchsorted(terms, add_terms, side="right")
        terms, rows, tf = np.insert(terms, at, add_terms), np.insert(rows, at, add_rows), np.insert(tf, at, add_tf)
    doc_len = np.concatenate([old.doc_len[kept_positions], np.diff(new_offsets)])
    return _assemble(terms, rows, tf, doc_len)


def bm25s_scores(counts: TermCounts, k1: float, b: float, method: str, dtype: str = "float32", int_dtype: str = "int32") -> Dict[str, Any]:
    """The ``scores`` dict bm25s's ``build_index_from_ids`` returns for these counts (``data``,
    ``indices``, ``indptr``, ``num_docs``), with the same values bit for bit (see the module doc)."""
    if method not in _IDF:
        raise ValueError(f"method {method!r} is not vectorised; one of {VECTORISED_METHODS}")
    n_docs = counts.n_docs
    avg_doc_len = counts.doc_len.mean() if n_docs else np.float64(np.nan)
    df = np.diff(counts.indptr)
    idf_of = _IDF[method]
    values, inverse = np.unique(df, return_inverse=True)
    idf = np.array([idf_of(int(v), n_docs) for v in values.tolist()], dtype=np.float64)[inverse].astype(dtype)
    # Per document, in float64 as bm25s computes it with Python floats and a numpy float64 mean
    # (every method's denominator term: k1 * ((1 - b) + b * |d| / avgdl)).
    doc_term = k1 * ((1 - b) + b * counts.doc_len / avg_doc_len)
    tf = counts.tf.astype(dtype)
    per_entry = doc_term[counts.rows].astype(_MIXED)
    if method == "atire":
        tfc = (tf * (k1 + 1)) / (tf + per_entry)
    else:
        tfc = tf / (per_entry + tf)
    column_idf = np.repeat(idf, df)
    data = (column_idf * tfc).astype(dtype)
    return {
        "data": data,
        # Shared with the counts, not copied (neither side changes them): the counts then add
        # only their term frequencies (2 bytes per entry) to what bm25s holds.
        "indices": counts.rows.astype(int_dtype, copy=False),
        "indptr": counts.indptr.astype(np.int64, copy=False),
        "num_docs": n_docs,
    }


class CountedCorpus:
    """What :meth:`CountedBM25.index` takes: bm25s's corpus object (``ids`` and ``vocab``), here
    the counts of every document and the ``{term: column}`` vocabulary of the columns."""

    def __init__(self, counts: TermCounts, vocab: Dict[str, int]) -> None:
        if len(vocab) != len(counts.column_terms):
            raise ValueError(f"the vocabulary has {len(vocab)} terms for {len(counts.column_terms)} matrix columns")
        self.ids = counts
        self.vocab = vocab


class CountedBM25(bm25s.BM25):
    """``bm25s.BM25`` whose ``build_index_from_ids`` takes :class:`TermCounts` (through
    :class:`CountedCorpus`) for the :data:`VECTORISED_METHODS`; any other corpus or method is
    built by bm25s itself. Saved and loaded as any ``bm25s.BM25``."""

    def build_index_from_ids(
        self, unique_token_ids: List[int], corpus_token_ids: Any, show_progress: bool = True, leave_progress: bool = False
    ) -> Dict[str, Any]:
        if isinstance(corpus_token_ids, TermCounts):
            if self.method not in VECTORISED_METHODS or self.idf_method != self.method:
                raise ValueError(f"TermCounts are built into a matrix for methods {VECTORISED_METHODS}, not {self.method!r}")
            self.nonoccurrence_array = None
            return bm25s_scores(corpus_token_ids, self.k1, self.b, self.method, self.dtype, self.int_dtype)
        return super().build_index_from_ids(unique_token_ids, corpus_token_ids, show_progress=show_progress, leave_progress=leave_progress)


def column_vocab(vocab: Sequence[str], column_terms: np.ndarray) -> Dict[str, int]:
    """``{term: column}`` for the matrix columns (terms in column order)."""
    return {vocab[t]: i for i, t in enumerate(column_terms.tolist())}


def counted_index(counts: TermCounts, vocab: Sequence[str], k1: float, b: float, method: str) -> Optional[CountedBM25]:
    """A bm25s index of ``counts`` (None when no document has a term), as ``bm25s.BM25(k1, b,
    method, backend="numpy").index(corpus, create_empty_token=False)`` would build it."""
    if len(counts.tf) == 0:
        return None
    bm25 = CountedBM25(k1=k1, b=b, method=method, backend="numpy")
    bm25.index(CountedCorpus(counts, column_vocab(vocab, counts.column_terms)), create_empty_token=False, show_progress=False)
    return bm25
