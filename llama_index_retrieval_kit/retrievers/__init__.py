"""Retrievers: BM25 keyword search (bm25s), rank/score fusion, a hybrid retriever fusing any legs,
and Qdrant-native hybrid search."""

from .bm25 import BM25Retriever, BM25TokenizerConfig
from .exact_dense import DenseMatrix, ExactDenseRetriever
from .filters import metadata_matches
from .fusion import FusedNodeWithScore, reciprocal_rank_fusion, score_fusion
from .hybrid import HybridRetriever
from .qdrant_hybrid import QdrantHybridRetriever

__all__ = [
    "BM25Retriever",
    "BM25TokenizerConfig",
    "DenseMatrix",
    "ExactDenseRetriever",
    "FusedNodeWithScore",
    "HybridRetriever",
    "metadata_matches",
    "QdrantHybridRetriever",
    "reciprocal_rank_fusion",
    "score_fusion",
]
