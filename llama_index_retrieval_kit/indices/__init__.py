"""Indexes: the hybrid storage folder and the embedding cache."""

from .embedding_cache import EmbeddingCache, embed_texts
from .hybrid_index import (
    RETRIEVER_MODES,
    RETRIEVER_OPTIONS,
    DocumentIdConflictError,
    HybridIndex,
    IndexBusyError,
)
from .storage import DamagedIndexError, IndexReadOnlyError, IndexWriteLockedError

__all__ = [
    "HybridIndex",
    "RETRIEVER_MODES",
    "RETRIEVER_OPTIONS",
    "DocumentIdConflictError",
    "IndexBusyError",
    "DamagedIndexError",
    "IndexReadOnlyError",
    "IndexWriteLockedError",
    "EmbeddingCache",
    "embed_texts",
]
