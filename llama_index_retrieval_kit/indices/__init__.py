"""Indexes: the hybrid storage folder and the embedding cache."""

from .embedding_cache import EmbeddingCache, embed_texts
from .hybrid_index import (
    RETRIEVER_MODES,
    RETRIEVER_OPTIONS,
    DocumentIdConflictError,
    HybridIndex,
    IndexBusyError,
)

__all__ = [
    "HybridIndex",
    "RETRIEVER_MODES",
    "RETRIEVER_OPTIONS",
    "DocumentIdConflictError",
    "IndexBusyError",
    "EmbeddingCache",
    "embed_texts",
]
