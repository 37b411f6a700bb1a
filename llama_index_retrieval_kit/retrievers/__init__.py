"""Retrievers: BM25 keyword search (bm25s), rank/score fusion, and a hybrid retriever fusing any legs."""

from .bm25 import BM25Retriever, BM25TokenizerConfig
from .filters import metadata_matches
from .fusion import FusedNodeWithScore, reciprocal_rank_fusion, score_fusion
from .hybrid import HybridRetriever

__all__ = [
    "BM25Retriever",
    "BM25TokenizerConfig",
    "FusedNodeWithScore",
    "HybridRetriever",
    "metadata_matches",
    "reciprocal_rank_fusion",
    "score_fusion",
]
