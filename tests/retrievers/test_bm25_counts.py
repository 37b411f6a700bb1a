"""bm25_counts: the score matrix from term counts in arrays equals bm25s's own build bit for bit,
from scratch and after any sequence of deletes and inserts (bm25s is the oracle)."""

from __future__ import annotations

from typing import List

import bm25s
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llama_index.core.schema import TextNode

from llama_index_retrieval_kit.retrievers.bm25 import BM25Retriever, BM25TokenizerConfig, PackedTokens
from llama_index_retrieval_kit.retrievers.bm25_counts import (
    VECTORISED_METHODS,
    CountedBM25,
    TermCounts,
    count_terms,
    counted_index,
    updated_counts,
)

terms = st.sampled_from([f"t{i}" for i in range(40)])
documents = st.lists(st.lists(terms, max_size=25), min_size=1, max_size=30)
methods = st.sampled_from(VECTORISED_METHODS)
k1s = st.sampled_from([0.0, 0.9, 1.2, 1.5, 2.0])
bs = st.sampled_from([0.0, 0.5, 0.75, 1.0])


def _reference(tokens: PackedTokens, k1: float, b: float, method: str) -> bm25s.BM25:
    """What build_snapshot built before: bm25s's own index of the same token ids."""
    ref = bm25s.BM25(k1=k1, b=b, method=method, backend="numpy")
    ref.index(tokens.bm25s_corpus(), create_empty_token=False, show_progress=False)
    return ref


def _assert_same_index(got: bm25s.BM25, want: bm25s.BM25) -> None:
    for key in ("data", "indices", "indptr"):
        assert got.scores[key].dtype == want.scores[key].dtype, key
        assert np.array_equal(got.scores[key], want.scores[key]), key  # bit for bit
    assert got.scores["num_docs"] == want.scores["num_docs"]
    assert got.vocab_dict == want.vocab_dict and got.nonoccurrence_array is None


@settings(max_examples=150, deadline=None)
@given(docs=documents, method=methods, k1=k1s, b=bs)
def test_counted_matrix_equals_bm25s(docs: List[List[str]], method: str, k1: float, b: float) -> None:
    tokens = PackedTokens.pack(docs)
    got = counted_index(count_terms(tokens.ids, tokens.offsets), tokens.vocab, k1, b, method)
    if not len(tokens.ids):
        assert got is None
        return
    _assert_same_index(got, _reference(tokens, k1, b, method))


@settings(max_examples=150, deadline=None)
@given(docs=documents, steps=st.lists(st.tuples(st.lists(st.booleans(), max_size=30), st.lists(st.lists(terms, max_size=25), max_size=6)), min_size=1, max_size=4),
       method=methods, k1=k1s, b=bs)
def test_updated_counts_equal_counting_again(docs, steps, method: str, k1: float, b: float) -> None:
    """Deletes and inserts applied to the counts give the counts (and matrix) of the new corpus."""
    tokens = PackedTokens.pack(docs)
    counts = count_terms(tokens.ids, tokens.offsets)
    for keep_mask, new_docs in steps:
        kept = [i for i in range(len(tokens)) if i < len(keep_mask) and keep_mask[i]]
        tokens = tokens.select(kept).extend(new_docs)
        start = int(tokens.offsets[len(kept)])
        counts = updated_counts(counts, kept, tokens.ids[start:], tokens.offsets[len(kept):] - start)
        again = count_terms(tokens.ids, tokens.offsets)
        for field in ("tf", "rows", "indptr", "column_terms", "doc_len"):
            assert np.array_equal(getattr(counts, field), getattr(again, field)), field
        if len(tokens.ids):
            _assert_same_index(counted_index(counts, tokens.vocab, k1, b, method), _reference(tokens, k1, b, method))


def test_large_counts_widen_and_bad_input_is_refused() -> None:
    tokens = PackedTokens.pack([["a"] * 70_000, ["a", "b"]])
    counts = count_terms(tokens.ids, tokens.offsets)
    assert counts.tf.dtype == np.int32 and counts.tf.max() == 70_000
    _assert_same_index(counted_index(counts, tokens.vocab, 1.5, 0.75, "lucene"), _reference(tokens, 1.5, 0.75, "lucene"))
    with pytest.raises(ValueError, match="kept positions must be strictly increasing"):
        updated_counts(counts, [1, 0], np.zeros(0, np.int64), np.zeros(1, np.int64))
    with pytest.raises(ValueError, match="TermCounts are built into a matrix for methods .*, not .bm25l."):
        CountedBM25(method="bm25l").build_index_from_ids([0], counts)
    small = count_terms(PackedTokens.pack([["a"]]).ids, PackedTokens.pack([["a"]]).offsets)
    assert isinstance(small, TermCounts) and small.tf.dtype == np.uint16


@pytest.mark.parametrize("method", [*VECTORISED_METHODS, "bm25l", "bm25+"])
def test_retriever_updates_keep_the_matrix_bm25s_would_build(method: str, tmp_path) -> None:
    """Through BM25Retriever: inserts, replacements and deletes leave the snapshot's matrix equal to
    bm25s's build of its tokens, and a saved and reloaded index (counts rebuilt) stays equal."""
    config = BM25TokenizerConfig(stemmer_language=None, stopwords=None)

    def node(i: int, text: str) -> TextNode:
        return TextNode(id_=f"n{i}", text=text, metadata={"doc_id": f"d{i % 5}"})

    words = "fee annual late payment interest rate card account balance statement".split()
    texts = [" ".join(words[(i * 3 + j) % len(words)] for j in range(i % 7 + 1)) for i in range(30)]
    bm25 = BM25Retriever([node(i, t) for i, t in enumerate(texts[:20])], tokenizer_config=config, method=method)

    def check(retriever: BM25Retriever) -> None:
        snapshot = retriever.snapshot
        _assert_same_index_or_bm25s(snapshot.bm25, _reference(snapshot.tokens, 1.5, 0.75, method))  # the retriever's defaults

    check(bm25)
    bm25.insert_nodes([node(i, t) for i, t in enumerate(texts[20:], start=20)])
    check(bm25)
    bm25.insert_nodes([node(3, "replacement text about the annual fee")])  # replaces n3
    bm25.delete_ref_doc("d2")
    check(bm25)
    bm25.persist(tmp_path)
    loaded = BM25Retriever.load(tmp_path)
    loaded.insert_nodes([node(99, "late fee late fee")])
    check(loaded)
    assert [n.node_id for n in loaded.retrieve("late fee")][:1] == ["n99"]


def _assert_same_index_or_bm25s(got: bm25s.BM25, want: bm25s.BM25) -> None:
    """bm25l / bm25+ are built by bm25s itself: compare what both have."""
    if got.nonoccurrence_array is not None:
        for key in ("data", "indices", "indptr"):
            assert np.array_equal(got.scores[key], want.scores[key]), key
        assert np.array_equal(got.nonoccurrence_array, want.nonoccurrence_array) and got.vocab_dict == want.vocab_dict
    else:
        _assert_same_index(got, want)
