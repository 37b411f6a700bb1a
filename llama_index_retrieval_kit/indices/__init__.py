"""Indexes: the hybrid storage folder and the embedding cache."""

from .embedding_cache import EmbeddingCache, embed_texts
from .hybrid_index import RETRIEVER_MODES, HybridIndex

__all__ = ["HybridIndex", "RETRIEVER_MODES", "EmbeddingCache", "embed_texts"]
