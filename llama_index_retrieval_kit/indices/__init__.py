"""Indexes: the hybrid storage folder (its manifest, write journal and point store) and the embedding cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS = {
    "EmbeddingCache": ".embedding_cache",
    "embed_texts": ".embedding_cache",
    "RETRIEVER_MODES": ".hybrid_index",
    "RETRIEVER_OPTIONS": ".hybrid_index",
    "ChunkIdConflictError": ".hybrid_index",
    "DocumentIdConflictError": ".hybrid_index",
    "HybridIndex": ".hybrid_index",
    "IndexBusyError": ".hybrid_index",
    "EmbedSettingsMismatchError": ".hybrid_index",
    "IndexBeingPublishedError": ".hybrid_index",
    "StaleServerCopyError": ".hybrid_index",
    "InterruptedCacheWriteError": ".embedding_cache",
    "ForeignCollectionError": ".store",
    "IndexManifest": ".manifest",
    "DamagedIndexError": ".storage",
    "IndexReadOnlyError": ".storage",
    "IndexWriteLockedError": ".storage",
    "FolderLockTimeout": ".._files",
    "EdgePoints": ".store",
    "ServerPoints": ".store",
}

__all__ = [
    "HybridIndex",
    "RETRIEVER_MODES",
    "RETRIEVER_OPTIONS",
    "ChunkIdConflictError",
    "DocumentIdConflictError",
    "IndexBusyError",
    "EmbedSettingsMismatchError",
    "IndexBeingPublishedError",
    "StaleServerCopyError",
    "InterruptedCacheWriteError",
    "ForeignCollectionError",
    "IndexManifest",
    "DamagedIndexError",
    "IndexReadOnlyError",
    "IndexWriteLockedError",
    "FolderLockTimeout",
    "EmbeddingCache",
    "embed_texts",
    "EdgePoints",
    "ServerPoints",
]

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)

if TYPE_CHECKING:  # the real imports, for type checkers and IDEs
    from .._files import FolderLockTimeout
    from .embedding_cache import EmbeddingCache, InterruptedCacheWriteError, embed_texts
    from .hybrid_index import (
        RETRIEVER_MODES,
        RETRIEVER_OPTIONS,
        ChunkIdConflictError,
        DocumentIdConflictError,
        HybridIndex,
        IndexBeingPublishedError,
        IndexBusyError,
        EmbedSettingsMismatchError,
        StaleServerCopyError,
    )
    from .manifest import IndexManifest
    from .storage import DamagedIndexError, IndexReadOnlyError, IndexWriteLockedError
    from .store import EdgePoints, ForeignCollectionError, ServerPoints
