"""The in-memory dense search of local mode answers exactly like Qdrant's own search."""

from __future__ import annotations

from pathlib import Path

import pytest
from llama_index.core.schema import QueryBundle

from llama_index_retrieval_kit.indices import HybridIndex
from llama_index_retrieval_kit.indices.fused_retriever import FusedIndexRetriever
from llama_index_retrieval_kit.retrievers import HybridRetriever

from . import _support


@pytest.mark.parametrize("top_k", [5, 60])
def test_memory_dense_search_ranks_like_qdrant(index: HybridIndex, bundles, top_k: int) -> None:
    memory = index.as_retriever("dense", similarity_top_k=top_k, dense_search="memory")
    qdrant = index.as_retriever("dense", similarity_top_k=top_k, dense_search="qdrant")
    for qb in bundles:
        got, want = memory.retrieve(qb), qdrant.retrieve(qb)
        _support.assert_same_ranking(_support.ranking(got), _support.ranking(want), tol=1e-6, truncated=True)
        for g, w in zip(got, want):
            if g.node.node_id == w.node.node_id:
                assert g.node.get_content() == w.node.get_content() and g.node.metadata == w.node.metadata


@pytest.mark.parametrize("mode", ["hybrid_score", "hybrid_rrf"])  # "hybrid": test_hybrid_index_retrievers.py
def test_auto_uses_memory_in_local_mode_and_fused_modes_agree(index: HybridIndex, bundles, mode: str) -> None:
    auto = index.as_retriever(mode, similarity_top_k=10)
    assert isinstance(auto, FusedIndexRetriever)
    qdrant = index.as_retriever(mode, similarity_top_k=10, dense_search="qdrant")
    assert not isinstance(qdrant, FusedIndexRetriever)
    for qb in bundles[:10]:
        _support.assert_same_ranking(
            _support.ranking(auto.retrieve(qb)), _support.ranking(qdrant.retrieve(qb)), tol=1e-6, truncated=True
        )


@pytest.mark.parametrize("fusion, mode", [("score", "hybrid_score"), ("rrf", "hybrid_rrf")])
@pytest.mark.parametrize("top_k, depth, weights", [(10, 100, None), (5, 20, [0.7, 0.3]), (60, 60, [1.0, 0.0])])
def test_array_fusion_equals_the_generic_hybrid_retriever(index: HybridIndex, bundles, fusion, mode, top_k, depth, weights) -> None:
    """Same legs, fused by HybridRetriever on NodeWithScore objects: identical ids, order, scores, traces."""
    fast = index.as_retriever(mode, similarity_top_k=top_k, candidate_top_k=depth, weights=weights)
    generic = HybridRetriever(
        [index.as_retriever("sparse", similarity_top_k=depth), index.as_retriever("dense", similarity_top_k=depth)],
        names=["bm25", "dense"],
        mode=fusion,
        weights=weights,
        similarity_top_k=top_k,
    )
    for qb in bundles:
        got, want = fast.retrieve(qb), generic.retrieve(qb)
        assert [r.node.node_id for r in got] == [r.node.node_id for r in want], qb.query_str
        assert [r.score for r in got] == [r.score for r in want]
        assert [r.leg_ranks for r in got] == [r.leg_ranks for r in want]
        assert [r.leg_scores for r in got] == [r.leg_scores for r in want]


def test_dense_matrix_follows_upserts_and_deletes(index: HybridIndex, embed_model) -> None:
    retriever = index.as_retriever("dense", similarity_top_k=3)  # made before the writes
    query = QueryBundle("zephyrquartz network beacon approximate region", embedding=None)
    before = retriever.retrieve(query)
    assert _support.NEW_SENTENCE not in " ".join(r.node.get_content() for r in before)
    index.upsert([_support.changed_document()])
    after = retriever.retrieve(QueryBundle(query.query_str))
    assert _support.NEW_SENTENCE.split(",")[0] in after[0].node.get_content()
    assert len(index.dense_matrix()) == len(index)
    index.delete(_support.CHANGED_DOC)
    gone = retriever.retrieve(QueryBundle(query.query_str))
    assert all(r.node.ref_doc_id != _support.CHANGED_DOC for r in gone)
    assert len(index.dense_matrix()) == len(index)


def test_unknown_dense_search_is_rejected(index: HybridIndex) -> None:
    with pytest.raises(ValueError, match="unknown dense search .faiss.; allowed: .auto., .memory., .qdrant."):
        index.as_retriever("dense", dense_search="faiss")
    with pytest.raises(ValueError, match="mode='sparse' does not use dense_search"):  # never silently ignored
        index.as_retriever("sparse", dense_search="memory")


def test_empty_index_answers_nothing(tmp_path: Path, embed_model) -> None:
    with HybridIndex.from_documents([], tmp_path / "empty", embed_model=embed_model) as idx:
        assert idx.as_retriever("dense").retrieve("anything") == []
        assert idx.as_retriever("hybrid").retrieve("anything") == []


def test_the_dense_matrix_handed_out_is_read_only_and_pairs_the_bm25_snapshot(index: HybridIndex) -> None:
    """``dense_matrix()`` hands out the index's own vectors: read-only, so that a caller writing
    into them cannot change later rankings. Its nodes are the BM25 snapshot's own (the no-copy
    path of ``DenseMatrix.build``: one set of nodes in memory, filter masks shared by the legs)."""
    matrix = index.dense_matrix()
    assert len(matrix) > 0 and not matrix.vectors.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        matrix.vectors[:] = 0.0
    assert matrix.nodes is index.bm25.snapshot.nodes
