"""Retrievers: BM25 keyword search (bm25s), rank/score fusion, a hybrid retriever fusing any legs,
the array-fused retriever of one ``HybridIndex``, and Qdrant-native hybrid search."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "BM25Retriever": ".bm25",
    "BM25TokenizerConfig": ".bm25",
    "ChunkIdConflictError": ".node_identity",
    "DenseMatrix": ".exact_dense",
    "ExactDenseRetriever": ".exact_dense",
    "FilteredDense": ".exact_dense",
    "metadata_matches": ".filters",
    "FusedIndexRetriever": ".fused_index",
    "FusedNodeWithScore": ".fusion",
    "IndexFusion": ".fusion",
    "fuse_exact_scores": ".fusion",
    "reciprocal_rank_fusion": ".fusion",
    "score_fusion": ".fusion",
    "HybridRetriever": ".hybrid",
    "QdrantHybridRetriever": ".qdrant_hybrid",
}

__all__ = [
    "BM25Retriever",
    "BM25TokenizerConfig",
    "ChunkIdConflictError",
    "DenseMatrix",
    "ExactDenseRetriever",
    "FilteredDense",
    "fuse_exact_scores",
    "FusedIndexRetriever",
    "FusedNodeWithScore",
    "IndexFusion",
    "HybridRetriever",
    "metadata_matches",
    "QdrantHybridRetriever",
    "reciprocal_rank_fusion",
    "score_fusion",
]

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from .bm25 import BM25Retriever, BM25TokenizerConfig
    from .exact_dense import DenseMatrix, ExactDenseRetriever, FilteredDense
    from .filters import metadata_matches
    from .fused_index import FusedIndexRetriever
    from .fusion import FusedNodeWithScore, IndexFusion, fuse_exact_scores, reciprocal_rank_fusion, score_fusion
    from .hybrid import HybridRetriever
    from .node_identity import ChunkIdConflictError
    from .qdrant_hybrid import QdrantHybridRetriever
