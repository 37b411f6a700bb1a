"""``HybridIndex``: one storage folder holding a Qdrant collection, a BM25 index and a docstore.

Layout of ``storage_dir``::

    index.json            the manifest (:mod:`.manifest`: embedding model, parser, BM25 settings, generation)
    edge/                 the Qdrant Edge shard: Qdrant's engine in-process (absent when
                          ``qdrant_url`` points at a server)
    bm25/gen-<N>/         the BM25 index of generation N
    docstore/gen-<N>.json every node (parents too), for AutoMergingRetriever and re-indexing
    embeddings.sqlite     embedding cache keyed by (model, text hash)

Writes are crash-safe (:mod:`.journal`): an update first records the node ids it will touch in
``index.json`` (``pending``), then writes Qdrant and the next generation's files, then switches
``index.json`` to the new generation in one atomic rename. Opening a folder whose last update
did not finish rolls the point store back to the committed generation (vectors come from the embedding
cache), so the previous index is what you read. A write that fails with an exception does the
same roll-back at once in the live object; if that fails too, the journal keeps every touched
id (it only grows until a commit) and the next open repairs the folder.

A delete or upsert takes removed chunks out of every query path; their text leaves the folder's
files (Qdrant Edge's WAL and segments, the embedding cache) with :meth:`HybridIndex.purge`, which
rewrites the shard from the committed chunks through the same journal.

Folder safety (:mod:`.storage`): every value of ``index.json`` is validated before use; each
commit records the sha256 of the generation's BM25 and docstore files and the number of chunks,
checked on open (a damaged folder is a :class:`~.storage.DamagedIndexError` naming the file and
the rebuild command; folders written before checksums load unverified until their next write);
generation files and directory entries are fsynced; one writer at a time (threads of a process,
and processes through ``.write.lock``); :meth:`HybridIndex.from_documents` builds in a sibling
folder and moves it into place when complete, replacing only the index's own entries of the folder
(:func:`.storage.publish_into`: the user's files there are never moved or deleted). When a roll-back cannot be written (disk full),
the index opens read-only on the committed state.

Nothing :meth:`HybridIndex.load` reads is unpickled: the manifest and docstore are JSON, the BM25
index numpy arrays read with ``allow_pickle=False``, the point store Qdrant Edge's own files. A
folder of the first format (``format_version`` 1, Qdrant local mode in ``qdrant/``, which pickles
every point) is migrated once on open without reading ``qdrant/``: the points are rebuilt from the
docstore and the embedding cache, then ``qdrant/`` is deleted.

The shard is open in one process at a time (``edge/.store.lock``); a second open is an
:class:`IndexBusyError`. Any number of processes can open the folder with ``read_only=True``
beside it (no shard, no lock, no write: the in-memory modes, ``refresh()`` to follow the writer);
engine-side search from several workers goes through a Qdrant server (``qdrant_url=``).
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import sqlite3
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Collection, Dict, Iterator, List, NamedTuple, Optional, Sequence, Union

import numpy as np
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.node_parser import NodeParser, get_leaf_nodes
from llama_index.core.schema import BaseNode, Document, MetadataMode
from llama_index.core.storage.docstore import SimpleDocumentStore
from llama_index.core.vector_stores.types import MetadataFilters

from .._enums import DenseSearch, EngineFusion, RetrieverMode
from .._settings import engine_kwargs_for, settings_embed_model, settings_llm, settings_node_parser
from ..models import DEFAULT_EMBED_MODEL, default_embed_model, embed_model_name
from ..node_parser import SectionWindowNodeParser
from ..retrievers.bm25 import BM25Retriever, BM25TokenizerConfig
from ..retrievers.checks import check_positive_int
from ..retrievers.exact_dense import DenseMatrix, ExactDenseRetriever
from ..retrievers.filters import validate_filters
from ..retrievers.fused_index import FusedIndexRetriever
from ..retrievers.fusion import DEFAULT_FEEDBACK_DEPTH, DEFAULT_RRF_K, IndexFusion
from ..retrievers.hybrid import HybridRetriever
from ..retrievers.node_copy import copy_node
from ..node_parser.metadata import record_document_ids
from ..node_parser.tokenizer_identity import tokenizer_labels_agree
from ..retrievers.node_identity import ChunkIdConflictError, check_chunk_ids  # noqa: F401 (public here: indices.ChunkIdConflictError)
from ..retrievers.qdrant_hybrid import QdrantDenseRetriever, QdrantHybridRetriever, token_id
from . import storage as _storage
from . import store as _store
from .docstore import IndexDocumentStore
from .embedding_cache import EmbeddingCache, check_cache_schema, embed_texts, model_key, text_key
from .journal import WriteJournal, read_generation, split_touched
from .manifest import COLLECTION, FORMAT_VERSION, READABLE_FORMATS, BM25Settings, FolderState, IndexManifest, PendingWrite
from .manifest import embed_settings_of, new_index_id
from .manifest import new_build_id
from .rwlock import ReadWriteLock

logger = logging.getLogger(__name__)

STORE_DIR = "edge"
LEGACY_QDRANT_DIR = "qdrant"
RETRIEVER_MODES: tuple[str, ...] = tuple(m.value for m in RetrieverMode)
DENSE_SEARCH: tuple[str, ...] = tuple(m.value for m in DenseSearch)
#: Engine-side dense search (``qdrant_hybrid``, ``dense_search="qdrant"``) over at least this many
#: vectors without HNSW logs a hint to run :meth:`HybridIndex.optimize` (an exact scan of 50k
#: 384-d vectors takes about 4 ms per query on 2 cores).
PLAIN_SCAN_HINT_VECTORS = 50_000
#: The progress line of Qdrant Edge's HNSW build (:meth:`HybridIndex.optimize`): one opaque call.
HNSW_STEP = "Building HNSW (one Qdrant Edge call, no progress inside it)"
#: The bar over the points an open rewrites to roll back an unfinished write (:meth:`HybridIndex.load`).
ROLL_BACK_STEP = "Rolling back an unfinished write"


def _describe_model(class_name: Optional[str], name: str) -> str:
    """``'name' (ClassName)`` for error messages (a model name alone can be as vague as 'unknown')."""
    return f"{name!r} ({class_name})" if class_name else repr(name)


def _check_embedding_cache(embedding_cache: Any) -> Optional[Path]:
    """``from_documents(embedding_cache=)`` as a path to an existing file (None: none given)."""
    if embedding_cache is None:
        return None
    if not isinstance(embedding_cache, (str, os.PathLike)):
        raise TypeError(f"embedding_cache must be a path (str or Path) to an embeddings.sqlite, got {embedding_cache!r}")
    path = Path(embedding_cache)
    if not path.is_file():
        raise ValueError(f"embedding_cache {str(path)!r} is not a file: pass the path of an embedding cache (an index's embeddings.sqlite)")
    return path


def _seed_embedding_cache(dest: Path, source: Path) -> None:
    """Add to the cache file ``dest`` the vectors of the cache file ``source`` it lacks: a copy
    (SQLite backup) when ``dest`` does not exist, else ``INSERT OR IGNORE``. ``source`` is opened
    read-only and never changed; one that is not an embedding cache is a ValueError naming it, and
    ``dest`` stays as it was."""
    uri = f"{source.resolve().as_uri()}?mode=ro"
    created = not dest.exists()
    try:
        with contextlib.closing(sqlite3.connect(uri, uri=True)) as src:
            check_cache_schema(src, source)
            if created:
                with contextlib.closing(sqlite3.connect(str(dest))) as dst:
                    src.backup(dst)
                return
        EmbeddingCache(dest).close()  # the table, when missing
        with contextlib.closing(sqlite3.connect(dest.resolve().as_uri(), uri=True)) as dst:
            dst.execute("ATTACH DATABASE ? AS seed", (uri,))
            with dst:
                dst.execute("INSERT OR IGNORE INTO vectors (model, key, dim, vector) SELECT model, key, dim, vector FROM seed.vectors")
            dst.execute("DETACH DATABASE seed")
    except (sqlite3.Error, ValueError) as exc:
        if created:
            for part in dest.parent.glob(dest.name + "*"):
                part.unlink(missing_ok=True)
        if isinstance(exc, ValueError):
            raise
        raise ValueError(f"{source} is not a readable embedding cache ({type(exc).__name__}: {exc})") from None


def _prepare_build_folder(build: Path, storage: Path, embedding_cache: Optional[Path] = None) -> Optional[Path]:
    """Empty the build folder of an earlier, interrupted build, keeping its embedding cache, and
    add to that cache the vectors of ``embedding_cache`` (a file the caller named). Returns the
    cache in ``storage`` when it is the index's own (the index being replaced, untouched until the
    new one is complete) or one an interrupted publish left there: the build draws from it only
    the vectors of its own chunks (:func:`_open_build_cache`), so a rebuild carries no row of a
    chunk it no longer has (a deleted document's text hash and vector) into the new folder. A cache
    file in a folder holding no index is the user's: never read, moved or changed (None)."""
    kept = _storage.clear_build_folder(build, keep_prefix="embeddings.sqlite")
    dest = build / "embeddings.sqlite"
    if kept:
        logger.info("%s: reusing the embedding cache of an interrupted build", build)
    if embedding_cache is not None:
        _seed_embedding_cache(dest, embedding_cache)
    source = storage / "embeddings.sqlite"
    ours = (storage / _storage.MANIFEST).exists() or source.name in _storage.publish_leftovers(storage)
    return source if ours and source.is_file() else None


def _open_build_cache(build: Path, replaced: Optional[Path]) -> EmbeddingCache:
    """The build's embedding cache, drawing the vectors it lacks from the replaced index's cache
    ``replaced`` (``EmbeddingCache(seed_from=)``) when that one is readable (else with a warning)."""
    dest = build / "embeddings.sqlite"
    if replaced is not None:
        try:
            return EmbeddingCache(dest, seed_from=replaced)
        except ValueError as exc:
            logger.warning("%s: not reusing the embedding cache of the replaced index (%s)", replaced, exc)
    return EmbeddingCache(dest)


def _exclusive_write(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run an index write alone, from its first read of the index to its commit: other threads of
    this process wait, and so do other processes and other HybridIndex objects on the folder
    (``flock`` on its ``.write.lock``; waited for up to ``storage.DEFAULT_LOCK_TIMEOUT`` = 60 s,
    then ``storage.IndexWriteLockedError``). The write then starts from the committed state on
    disk (another process sharing a Qdrant server may have committed since). The cyclic garbage
    collector is paused meanwhile (``storage.paused_gc``)."""

    @functools.wraps(method)
    def guarded(self: "HybridIndex", *args: Any, **kwargs: Any) -> Any:
        self._check_writable()
        with self._write_guard.hold(), _storage.paused_gc():  # bulk allocation: see storage.paused_gc
            self._check_writable()
            with self._rw_lock.write():  # a roll-back or a newer generation: Qdrant readers wait
                self._sync_with_disk()
            return method(self, *args, **kwargs)

    return guarded


def server_client(url: str, api_key: Optional[str] = None) -> Any:
    """The ``QdrantClient`` of a Qdrant server or cluster (one place, so tests can stand in
    qdrant-client's local mode for a server)."""
    from qdrant_client import QdrantClient

    return QdrantClient(url=url, api_key=api_key)


def check_collection_name(name: Any, served: bool = False) -> str:
    """``name`` when it can name an index's collection: letters, digits, '_' and '-'
    (``storage.SAFE_NAME``), not in the form of a build collection (``<name>-<12 hex digits>``), and
    with ``served`` (served on a server) at most ``store.MAX_SERVED_NAME`` characters."""
    longest = _store.MAX_SERVED_NAME if served else 128
    if not isinstance(name, str) or not _storage.SAFE_NAME.fullmatch(name) or len(name) > longest:
        raise ValueError(f"collection must be letters, digits, '_' and '-' (at most {longest}), got {name!r}")
    if _store.is_build_collection_name(name):
        raise ValueError(
            f"collection {name!r} ends in '-' and {_store.BUILD_SUFFIX_HEX} hex digits, the form of the collections "
            "this package builds on a server; choose another name"
        )
    return name


class CollectionPlan(NamedTuple):
    """Where :meth:`HybridIndex.from_documents` writes (see :class:`.store.ServerCollections`)."""

    name: str  # the name it is served under (on a server, an alias)
    collection: str  # what index.json records: ``name`` when embedded, a new build collection on a server
    index_id: str  # the index's id: the replaced index's, else new
    url: Optional[str]  # the Qdrant server, or None
    replaced: Optional[str]  # the replaced index's collection on that server, checked to be its own


def _replaced_manifest(storage: Path) -> Optional[IndexManifest]:
    """The manifest of the index a rebuild replaces, or None (none there, or unreadable: a damaged
    folder is rebuilt without taking anything from it)."""
    path = storage / _storage.MANIFEST
    if not path.exists():
        return None
    try:
        return IndexManifest.read(path, READABLE_FORMATS)
    except (ValueError, OSError) as exc:  # DamagedIndexError is a ValueError
        logger.warning("%s: the replaced index's manifest is unreadable (%s); its server collection, if any, is left alone", path, exc)
        return None


def _own_server_collection(names: "_store.ServerCollections", old: Optional[IndexManifest], url: str, index_id: str) -> Optional[str]:
    """The collection the replaced index ``old`` reads on the server ``url`` when it is provably
    its own: marked with its id, or (an index written before ids) unmarked and holding exactly its
    chunks. None otherwise: then nothing of it is deleted."""
    if old is None or old.qdrant_url != url or names.target(old.collection) != old.collection:
        return None
    owner = names.owner(old.collection)
    if owner is not None:
        return old.collection if owner == index_id else None
    if old.index_id is not None:
        return None
    chunks = old.integrity.chunks if old.integrity is not None else None
    return old.collection if chunks is None or names.count(old.collection) == chunks else None


class IndexBusyError(RuntimeError):
    """The index folder is open elsewhere (the embedded Qdrant Edge shard opens in one place at a time)."""

    def __init__(self, storage_dir: Path, rebuilding: bool = False) -> None:
        """``rebuilding``: a rebuild (``from_documents(overwrite=True)``) found the index open."""
        self.storage_dir = Path(storage_dir)
        if rebuilding:
            super().__init__(
                f"cannot rebuild the index in {storage_dir}: it is open in another process (or another HybridIndex "
                "in this one), which would write over the new index: close it there (index.close(), or end that "
                "process), then build again"
            )
            return
        super().__init__(
            f"index {storage_dir} is open in another process (or another HybridIndex in this one) and the "
            "embedded store allows one at a time: close the other one (index.close(), or end that process), "
            "or, for several workers, copy it to a Qdrant server with index.push_to(url) (rkit index --push URL) "
            "and open it with HybridIndex.load(dir, qdrant_url=url)"
        )


class IndexBeingPublishedError(ValueError):
    """A build is moving into the folder (``storage.PUBLISH_MARKER`` present, ``index.json`` not yet
    in place): nothing is damaged, the new index is there once the move ends. A publish that was
    killed is finished by the next writable open (``storage.resume_publish``)."""

    def __init__(self, storage_dir: Path) -> None:
        self.storage_dir = Path(storage_dir)
        super().__init__(
            f"{storage_dir} holds no index.json yet: an index is being published there (a build or rebuild is "
            "moving its files in): retry shortly (if no build is running, it was interrupted: open the folder "
            "once without read_only=True to finish it)"
        )


def _being_published(storage: Path) -> bool:
    """Whether ``storage`` has no ``index.json`` because a build is being published into it."""
    return not (storage / _storage.MANIFEST).exists() and (storage / _storage.PUBLISH_MARKER).exists()


def _disk_build_id(storage: Path) -> Optional[str]:
    """The build id ``index.json`` names now (None: none recorded, or no readable ``index.json``)."""
    try:
        return IndexManifest.read(storage / _storage.MANIFEST, READABLE_FORMATS).build_id
    except (ValueError, OSError):
        return None


def _replaced_while_read(storage: Path, build_id: Optional[str]) -> Optional[str]:
    """After an error reading ``storage``'s index of build ``build_id``: whether a rebuild in
    another process moved it away meanwhile (its publish moves the old index's files out, the new
    ones in, ``index.json`` last): ``"publishing"`` (no ``index.json``, a publish marker),
    ``"rebuilt"`` (another build's ``index.json`` in place), or None (the same build: the error
    is the folder's own)."""
    if _being_published(storage):
        return "publishing"
    try:
        disk = IndexManifest.read(storage / _storage.MANIFEST, READABLE_FORMATS)
    except (ValueError, OSError):
        return None
    return "rebuilt" if disk.build_id != build_id else None


def push_again_advice(storage_dir: Path, url: str) -> str:
    """What makes a server copy of an embedded folder current again: pushing the folder again."""
    return (
        f"Push the folder again: index.push_to({url!r}) in the process that writes {storage_dir} (or "
        f"`rkit index <documents> --storage {storage_dir} --push {url}`), then open it with qdrant_url= again"
    )


class StaleServerCopyError(ValueError):
    """The server collection an embedded folder is served from (``HybridIndex.load(dir,
    qdrant_url=url)``) is not a copy of the state the folder has committed: pushed before a later
    upsert or delete (so it still holds deleted or replaced text), changed on the server since, or
    pushed without a record of the state it copied (by an earlier version, or to a Qdrant server
    before 1.16, which drops collection metadata). The folder itself is fine: pushing it again
    (:meth:`HybridIndex.push_to`) is the fix. ``location`` names the collection, ``problem`` what
    differs."""

    def __init__(self, storage_dir: Path, location: str, url: str, problem: str) -> None:
        self.storage_dir = Path(storage_dir)
        self.location = location
        self.url = url
        self.problem = problem
        super().__init__(
            f"{location} {problem}, so serving {storage_dir} from it could return documents deleted or changed "
            f"since. {push_again_advice(self.storage_dir, url)}"
        )


class DocumentIdConflictError(ValueError):
    """An upsert would replace an indexed document with one read from a different file."""

    def __init__(self, conflicts: Sequence[tuple[str, str, str]], storage_dir: Path) -> None:
        self.conflicts = list(conflicts)
        lines = "\n".join(f"  - {doc_id!r}: indexed from {old}, now from {new}" for doc_id, old, new in self.conflicts[:10])
        more = f"\n  ... and {len(self.conflicts) - 10} more" if len(self.conflicts) > 10 else ""
        super().__init__(
            f"{len(self.conflicts)} document id(s) in {storage_dir} already belong to a different file; replacing "
            f"them would drop that file from the index:\n{lines}{more}\nGive the documents distinct ids "
            "(index their common parent folder, or pass doc_id_func=...), or pass allow_source_change=True "
            "(rkit index --allow-source-change) if the file really moved"
        )


def _describe_settings(settings: Dict[str, Any]) -> str:
    """``{'max_length': 64}`` for error messages; ``{}`` said as what it means."""
    return f"{settings!r}" if settings else "{} (the model used as it comes)"


def _configured_like(manifest: IndexManifest) -> str:
    """Python that makes a model with the index's recorded name and document-vector settings (for error messages)."""
    args = ", ".join(f"{k}={v!r}" for k, v in sorted((manifest.embed_settings or {}).items()))
    if manifest.embed_model == DEFAULT_EMBED_MODEL:
        return f"llama_index_retrieval_kit.models.default_embed_model({args})"
    name_arg = f"model_name={manifest.embed_model!r}"
    return f"{manifest.embed_model_class or 'HuggingFaceEmbedding'}({name_arg}{', ' + args if args else ''})"


class EmbedSettingsMismatchError(ValueError):
    """The embedding model has the index's model name but other settings that change document
    vectors (``max_length``, ``normalize``, ...; :func:`.manifest.embed_settings_of`) than the
    ones ``index.json`` records: its vectors are not comparable with the indexed ones."""

    def __init__(self, storage_dir: Path, manifest: IndexManifest, given: Dict[str, Any], source: str = "the given embed_model") -> None:
        """``source``: where the given model came from, as the message names it."""
        self.storage_dir = Path(storage_dir)
        self.recorded = dict(manifest.embed_settings or {})
        self.given = dict(given)
        built_with = _describe_model(manifest.embed_model_class, manifest.embed_model)
        super().__init__(
            f"{storage_dir} was built with embedding model {built_with} with the document-vector settings "
            f"{_describe_settings(self.recorded)}, but {source} has {_describe_settings(self.given)}: their vectors are not "
            "comparable (queries would be embedded otherwise, and an upsert would mix both kinds of vectors in one index). "
            f"Pass embed_model= that model configured with {_describe_settings(self.recorded)}, e.g. "
            f"embed_model={_configured_like(manifest)}, or rebuild the index with this model: "
            f"HybridIndex.from_documents(documents, {str(storage_dir)!r}, embed_model=..., overwrite=True) "
            "(`rkit index ... --rebuild` rebuilds with the model as it comes)"
        )


def _model_serves(manifest: IndexManifest, embed_model: BaseEmbedding) -> bool:
    """Whether ``embed_model`` makes the index's vectors: its name, and its document-vector
    settings when the index records them."""
    return embed_model_name(embed_model) == manifest.embed_model and manifest.embed_settings_match(embed_settings_of(embed_model))


def _resolved(path: str) -> str:
    try:
        return str(Path(path).expanduser().resolve())
    except (OSError, RuntimeError, ValueError):
        return path


def _source_names_a_file(metadata: Dict[str, Any]) -> bool:
    """Whether ``metadata["source"]`` is a file's path: an absolute one, or one whose last part is
    ``metadata["file_name"]`` (the pair this package's readers wrote before ``file_path``)."""
    source, name = metadata.get("source"), metadata.get("file_name")
    if not isinstance(source, str) or not source:
        return False
    return Path(source).is_absolute() or (isinstance(name, str) and bool(name) and Path(source).name == name)


def document_origin(metadata: Dict[str, Any]) -> Optional[str]:
    """The absolute path of the file a document or chunk was read from, or None when unknown.

    ``metadata["file_path"]`` (written by this package's readers, and by LlamaIndex's
    ``SimpleDirectoryReader``); for chunks indexed before it existed, ``source`` when it names a
    file (:func:`_source_names_a_file`). Any other ``source`` is a label, not a file: a URL, a
    system's name, or the document id the node parsers record when a document has none. Such a
    document has no known file (None), so it is never taken for one whose file was deleted
    (``rkit index --prune``).
    """
    path = metadata.get("file_path")
    if isinstance(path, str) and path:
        return _resolved(path)
    return _resolved(metadata["source"]) if _source_names_a_file(metadata) else None


def document_provenance(metadata: Dict[str, Any]) -> Optional[str]:
    """What tells two documents with one id apart (:class:`DocumentIdConflictError`): the file
    (:func:`document_origin`), else the ``metadata["source"]`` label as given (a URL, a system's
    name: never resolved against the working folder, so the same label matches from anywhere),
    except the document id the node parsers record as a chunk's ``source`` when its document has
    none (no provenance: None)."""
    origin = document_origin(metadata)
    if origin is not None:
        return origin
    source = metadata.get("source")
    if not isinstance(source, str) or not source or source == metadata.get("doc_id"):
        return None
    return source


READ_ONLY_REASON = "it was opened with read_only=True"
READ_ONLY_ADVICE = (
    "Open it with HybridIndex.load(...) without read_only=True in the one process that writes, or use "
    "mode='hybrid' (or dense, sparse, hybrid_score, hybrid_rrf) here"
)
SERVED_ELSEWHERE_ADVICE = "Write through a HybridIndex.load of the folder without qdrant_url="
REBUILT_ADVICE = "Open it again with HybridIndex.load to use the new index"
PUSH_OVERWRITE_ADVICE = (
    "push_to replaces only a collection this index wrote itself. Push under another name (collection=...), or "
    "replace it with overwrite=True (rkit index --push URL --push-overwrite)"
)
BUILD_FOREIGN_ADVICE = (
    "a build never replaces a collection another index or application wrote. Build into another one "
    "(from_documents(collection=...), index.collection in a pipeline config), or delete that one on the server "
    "first if nothing uses it"
)
#: How often :func:`_read_committed` reads ``index.json`` again when the generation it named was
#: replaced by another process's commit while being read.
GENERATION_READ_ATTEMPTS = 5


class _UnopenedStore:
    """The point store of an index opened with ``read_only=True``: never opened; using it raises
    the index's :class:`~.storage.IndexReadOnlyError` (queries are refused before, by the read guard)."""

    kind = "edge"

    def __init__(self, path: Path, error: Exception) -> None:
        self.path = path
        self.location = str(path)
        self._error = error

    def close(self) -> None:
        """Nothing was opened."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # protocols (copy, pickle, hasattr probes) see a plain object
            raise AttributeError(name)
        raise self._error


def _read_committed(
    storage: Path, manifest: IndexManifest, custom_tokenizer: Any, qdrant_url: Optional[str]
) -> tuple[IndexManifest, bool, BM25Retriever, Any]:
    """The committed generation ``manifest`` names, checked and read: ``(manifest, verified, bm25,
    docstore)``; the docstore, or when verified a callable parsing it (see ``read_generation``).

    A writer in another process deletes a generation's files once it committed the next one;
    when the files go while they are read, ``index.json`` is read again and the newer generation
    read instead (up to :data:`GENERATION_READ_ATTEMPTS` times); damage is an error. A newer
    generation of another build (the folder was rebuilt meanwhile) is not followed: the error is
    raised, for the caller to tell (:func:`_replaced_while_read`)."""
    manifest_file = storage / _storage.MANIFEST
    for attempt in range(GENERATION_READ_ATTEMPTS):
        gen = manifest.generation
        try:
            verified = _storage.verify_generation(storage, gen, manifest.integrity_record, manifest_file)
            # A verified docstore is parsed on first use (a query-only process never parses it);
            # an unverified one now, so that damage is an error of the open.
            bm25, docstore = read_generation(storage, gen, custom_tokenizer, defer_docstore=verified)
            return manifest, verified, bm25, docstore
        except (_storage.DamagedIndexError, OSError):  # OSError: a file gone while it was hashed
            try:
                disk = IndexManifest.read(manifest_file, READABLE_FORMATS)
            except FileNotFoundError:
                if _being_published(storage):  # moved out by a rebuild's publish
                    raise IndexBeingPublishedError(storage) from None
                raise
            if disk.generation == gen or disk.build_id != manifest.build_id or attempt == GENERATION_READ_ATTEMPTS - 1:
                raise
            logger.info("%s: generation %d was replaced by %d while it was read; reading that", storage, gen, disk.generation)
            manifest = disk.with_qdrant_url(qdrant_url) if qdrant_url else disk
    raise AssertionError("unreachable")  # pragma: no cover


def _unreadable_cache(storage: Path, exc: Exception, read_only: bool = False) -> _storage.DamagedIndexError:
    """The error of an ``embeddings.sqlite`` SQLite cannot read (it only caches: deleting it is the repair)."""
    where = " (in a writable open)" if read_only else ""
    return _storage.DamagedIndexError(
        storage / "embeddings.sqlite",
        f"is not a readable SQLite database ({exc})",
        storage,
        repair=f"it only caches embeddings: delete it{where} and open the index again",
    )


def _rewrites_every_chunk(manifest: IndexManifest, bm25: BM25Retriever) -> bool:
    """Whether the unfinished write ``index.json`` records touched every committed chunk, as
    :meth:`HybridIndex.purge` does before it deletes the shard: its roll-back on open rewrites
    every point, so a shard found missing is rebuilt, not damage."""
    if manifest.pending is None:
        return False
    touched = set(manifest.pending.touched_ids)
    return all(node.node_id in touched for node in bm25.snapshot.nodes)


def _disk_usage(path: Path) -> int:
    """Bytes the file system gives to ``path`` (a file, or every file under a folder): allocated
    blocks where the platform reports them (sparse files count what they use), else sizes."""
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file() and not p.is_symlink()] if path.is_dir() else []
    total = 0
    for file in files:
        try:
            info = file.stat()
        except OSError:  # deleted meanwhile
            continue
        blocks = getattr(info, "st_blocks", None)
        total += blocks * 512 if blocks is not None else info.st_size
    return total


def _check_flag(name: str, value: Any) -> None:
    """A TypeError naming ``name`` unless ``value`` is True or False."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")


def _progress_bar(show_progress: bool, desc: str, total: int, unit: str) -> Any:
    """A tqdm bar on stderr over ``total`` units of real work (``tqdm.auto``, as the package's other
    bars), or None when ``show_progress`` is False."""
    if not show_progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit)


@contextlib.contextmanager
def _opaque_step(show_progress: bool, desc: str) -> Iterator[None]:
    """A progress line on stderr for a step that is one opaque call reporting no progress of its
    own (Qdrant Edge's optimize, SQLite's DELETE and VACUUM): ``desc`` while it runs, with its
    elapsed time once it returns (Edge's optimize holds the GIL: no thread could redraw the line
    meanwhile). Nothing when ``show_progress`` is False."""
    if not show_progress:
        yield
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=None, desc=desc, bar_format="{desc} [{elapsed}]")
    try:
        yield
    finally:
        bar.close()


def _close_quietly(store: Any, cache: Any) -> None:
    """Close a point store and an embedding cache, ignoring errors (finalizer of HybridIndex)."""
    for resource in (store, cache):
        try:
            resource.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            logger.debug("closing %r at exit failed", resource, exc_info=True)


def check_document_text(doc: Any) -> None:
    """Refuse a document whose text or string metadata is not valid Unicode (lone surrogates,
    e.g. from ``bytes.decode(errors="surrogateescape")``): tokenizers and JSON cannot take it."""
    if not isinstance(doc, Document):
        raise ValueError(f"upsert takes llama_index Document objects, got {type(doc).__name__}")
    fields = [("text", doc.text)] + [(f"metadata[{k!r}]", v) for k, v in doc.metadata.items() if isinstance(v, str)]
    for where, value in fields:
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"document {doc.id_!r}: {where} has an invalid character (lone surrogate {value[exc.start]!r} at "
                f"position {exc.start}); clean it first, e.g. text.encode('utf-8', 'replace').decode('utf-8')"
            ) from None


def check_unique_document_ids(documents: Sequence[Document]) -> None:
    """Refuse two documents with one id in the same batch, naming their files."""
    seen: Dict[str, Document] = {}
    clashes: List[str] = []
    for doc in documents:
        first = seen.setdefault(doc.id_, doc)
        if first is not doc:
            where = [document_origin(d.metadata) or "(no file)" for d in (first, doc)]
            clashes.append(f"{doc.id_!r} ({where[0]} and {where[1]})")
    if clashes:
        raise ValueError(
            f"documents with the same id in one upsert: {'; '.join(clashes[:5])}. Give each document its own "
            "id: read a folder (ids are paths relative to it) or pass doc_id_func=... to the reader"
        )


#: Node parser settings that do not change the chunks (LlamaIndex serialises id_func in a form it
#: cannot load back; this package's parsers ignore it: their ids derive from the span).
NODE_PARSER_NON_SETTINGS = ("callback_manager", "id_func")
#: Settings added later, with the value an index.json written before them means (a parser built
#: with a ``tokenizer=`` callable records its name; older manifests had none: the default tokenizer).
NODE_PARSER_ADDED_DEFAULTS: Dict[str, Any] = {"tokenizer_callable": None}


def node_parser_changes(built: Dict[str, Any], given: Dict[str, Any]) -> List[str]:
    """How the parser ``given`` (its ``to_dict()``) chunks otherwise than the one an index was
    built with (``built``: ``node_parser`` of ``index.json``), as ``"key: built with X, given Y"``.

    Compared as JSON: ``class_name``, then every setting both record (one that only one side
    records, added in another version, keeps its default there; those of
    :data:`NODE_PARSER_ADDED_DEFAULTS` are compared with that default, so a ``tokenizer=`` callable
    is a change), except :data:`NODE_PARSER_NON_SETTINGS`; tokenizer labels are compared with
    :func:`~..node_parser.tokenizer_identity.tokenizer_labels_agree`. Empty: the same chunking.
    """
    built, given = (json.loads(json.dumps(d, default=repr)) for d in (built, given))
    for key, default in NODE_PARSER_ADDED_DEFAULTS.items():
        if (key in built) != (key in given):
            built.setdefault(key, default)
            given.setdefault(key, default)
    if built.get("class_name") != given.get("class_name"):
        return [f"class: built with {built.get('class_name')}, given {given.get('class_name')}"]
    shared = sorted((set(built) & set(given)) - set(NODE_PARSER_NON_SETTINGS) - {"class_name"})
    return [
        f"{key}: built with {built[key]!r}, given {given[key]!r}"
        for key in shared
        if built[key] != given[key]
        and not (key == "tokenizer_callable" and tokenizer_labels_agree(built[key], given[key]))  # see there
    ]


#: Options each retriever mode takes besides ``similarity_top_k``, ``filters``,
#: ``callback_manager`` and ``verbose`` (which every mode takes). Anything else is refused.
RETRIEVER_OPTIONS: Dict[str, tuple[str, ...]] = {
    "hybrid": ("candidate_top_k", "weights", "dense_search"),
    "hybrid_score": ("candidate_top_k", "weights", "dense_search"),
    "hybrid_rrf": ("candidate_top_k", "rrf_k", "weights", "dense_search"),
    "dense": ("dense_search",),
    "sparse": (),
    "qdrant_hybrid": ("candidate_top_k", "rrf_k", "weights", "fusion", "leg_scores"),
}
COMMON_RETRIEVER_OPTIONS: tuple[str, ...] = ("similarity_top_k", "filters", "callback_manager", "verbose")


def check_retriever_mode(mode: Any) -> str:
    """``mode`` if it names a retriever mode; else a ValueError listing the modes."""
    return RetrieverMode.from_str(mode).value


def check_retriever_options(mode: str, options: Dict[str, Any]) -> Dict[str, Any]:
    """The options given (``None`` = not given) after checking that ``mode`` uses each one.

    An option of another mode is a ValueError naming the modes that take it; an unknown name is
    a TypeError listing what this mode takes. Nothing is silently dropped.
    """
    allowed = RETRIEVER_OPTIONS[check_retriever_mode(mode)]
    given = {k: v for k, v in options.items() if v is not None}
    for name in given:
        if name in allowed:
            continue
        takers = [m for m, names in RETRIEVER_OPTIONS.items() if name in names]
        if takers:
            raise ValueError(
                f"mode={mode!r} does not use {name}=...; it applies to mode(s) {', '.join(takers)}. "
                f"Remove it or choose one of those modes"
            )
        raise TypeError(
            f"unexpected keyword argument {name!r} for a retriever in mode={mode!r}; it takes: "
            f"{', '.join(COMMON_RETRIEVER_OPTIONS + allowed)}"
        )
    return given


def query_engine_options() -> tuple[str, ...]:
    """The keywords ``RetrieverQueryEngine.from_args`` really uses (its ``**kwargs`` are dropped)."""
    import inspect

    from llama_index.core.query_engine import RetrieverQueryEngine

    params = inspect.signature(RetrieverQueryEngine.from_args).parameters
    return tuple(
        name for name, p in params.items()
        if name not in ("retriever", "llm", "self", "cls") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    )


def check_node_postprocessors(value: Any) -> None:
    """A TypeError unless ``value`` is None or a list (tuple) of LlamaIndex node postprocessors:
    LlamaIndex takes anything and fails later (one postprocessor not in a list: "'tuple' object
    has no attribute 'callback_manager'"; a function: at the first query)."""
    from llama_index.core.postprocessor.types import BaseNodePostprocessor

    if value is None:
        return
    if isinstance(value, BaseNodePostprocessor):
        raise TypeError(f"node_postprocessors takes a list: pass node_postprocessors=[{type(value).__name__}(...)]")
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"node_postprocessors must be a list of LlamaIndex node postprocessors, got {type(value).__name__}")
    for i, item in enumerate(value):
        if not isinstance(item, BaseNodePostprocessor):
            raise TypeError(
                f"node_postprocessors[{i}] is {type(item).__name__}, not a LlamaIndex BaseNodePostprocessor "
                "(e.g. NoAnswerPostprocessor, CrossEncoderReranker, ContextAssembler, SimilarityPostprocessor)"
            )


def check_prompt_templates(engine_kwargs: Dict[str, Any]) -> None:
    """A TypeError for a ``*_template`` option of ``RetrieverQueryEngine.from_args`` that is not a
    LlamaIndex prompt template (a str fails only at the first query in LlamaIndex)."""
    from llama_index.core.prompts.base import BasePromptTemplate

    for name, value in engine_kwargs.items():
        if name.endswith("_template") and value is not None and not isinstance(value, BasePromptTemplate):
            raise TypeError(
                f"{name} must be a LlamaIndex prompt template, e.g. PromptTemplate(\"... {{context_str}} ... {{query_str}} ...\"), "
                f"got {type(value).__name__}"
            )


#: A keyword taker for :func:`route_keywords`: (its name in errors, the names it accepts, the names an error lists).
KeywordTaker = tuple[str, Collection[str], Sequence[str]]


def retriever_taker(mode: str) -> KeywordTaker:
    """The retriever of ``mode`` as a :data:`KeywordTaker`: it accepts every mode's options (one
    another mode uses is refused after, by :func:`check_retriever_options`, saying which modes use
    it) and an error lists this mode's."""
    shown = COMMON_RETRIEVER_OPTIONS + RETRIEVER_OPTIONS[check_retriever_mode(mode)]
    return f"the {mode!r} retriever", set(COMMON_RETRIEVER_OPTIONS).union(*RETRIEVER_OPTIONS.values()), shown


def route_keywords(caller: str, kwargs: Dict[str, Any], takers: Sequence[KeywordTaker]) -> List[Dict[str, Any]]:
    """``kwargs`` split among ``takers``, one dict each: a keyword goes to every taker accepting it
    (``verbose`` to the retriever and the engine, as in LlamaIndex); one none accepts is a TypeError
    naming ``caller`` and listing what each takes (never dropped)."""
    routed: List[Dict[str, Any]] = [{} for _ in takers]
    for name, value in kwargs.items():
        hits = [i for i, (_, accepted, _) in enumerate(takers) if name in accepted]
        if not hits:
            listed = " nor ".join(f"{who} ({', '.join(shown)})" for who, _, shown in takers)
            raise TypeError(f"{caller}() got an unexpected keyword argument {name!r}: neither {listed} takes it")
        for i in hits:
            routed[i][name] = value
    return routed


def split_query_engine_kwargs(mode: str, kwargs: Dict[str, Any]) -> tuple[Dict[str, Any], Dict[str, Any]]:
    """Split ``as_query_engine`` keywords into (retriever options, query-engine options).

    ``callback_manager`` and ``verbose`` go to both (as in LlamaIndex); a keyword that neither
    the retriever of ``mode`` nor ``RetrieverQueryEngine.from_args`` uses raises a TypeError, and so
    do postprocessors or prompt templates LlamaIndex would fail on only later
    (:func:`check_node_postprocessors`, :func:`check_prompt_templates`).
    """
    engine_names = query_engine_options()
    retriever_kwargs, engine_kwargs = route_keywords(
        "as_query_engine", kwargs, [retriever_taker(mode), ("RetrieverQueryEngine.from_args", engine_names, engine_names)]
    )
    check_retriever_options(mode, {k: v for k, v in retriever_kwargs.items() if k not in COMMON_RETRIEVER_OPTIONS})
    check_node_postprocessors(engine_kwargs.get("node_postprocessors"))
    check_prompt_templates(engine_kwargs)
    return retriever_kwargs, engine_kwargs


class HybridIndex:
    """Hybrid (BM25 + dense) index in one folder, with upserts, deletes and crash safety.

    Build with :meth:`from_documents`, reopen with :meth:`load`, query with
    :meth:`as_retriever` / :meth:`as_query_engine`. Defaults: the packaged offline MiniLM
    embedding model, :class:`SectionWindowNodeParser`, Qdrant Edge inside ``storage_dir``.
    """

    def __init__(
        self,
        storage_dir: Path,
        manifest: IndexManifest,
        embed_model: BaseEmbedding,
        node_parser: NodeParser,
        store: Any,
        bm25: BM25Retriever,
        docstore: Union[SimpleDocumentStore, Callable[[], SimpleDocumentStore]],
        tokenizer_config: BM25TokenizerConfig,
        cache: Optional[EmbeddingCache] = None,
    ) -> None:
        self.storage_dir = storage_dir
        self._journal = WriteJournal(storage_dir, manifest)  # index.json: the manifest and the write journal
        self.embed_model = embed_model
        self.node_parser = node_parser
        self.store = store  # the point store: indices.store.EdgePoints or ServerPoints
        self.bm25 = bm25
        self._docstore_lock = threading.Lock()
        self._set_docstore(docstore)
        self.tokenizer_config = tokenizer_config
        self.cache = cache if cache is not None else EmbeddingCache(storage_dir / "embeddings.sqlite")
        # An index never closed is closed when it is collected or at interpreter exit, before
        # module teardown (otherwise qdrant-client's __del__ prints a traceback at exit).
        self._finalizer = weakref.finalize(self, _close_quietly, store, self.cache)
        self._vector_store: Any = None
        self._dense: Optional[tuple] = None  # (BM25 snapshot, DenseMatrix aligned with it)
        self._dense_lock = threading.Lock()
        self._nodes_by_point: Optional[tuple] = None  # (BM25 snapshot, {point id: node}), see _node_lookup
        # Write side: an update changing the point store/BM25/docstore; read side: queries reading the store.
        self._rw_lock = ReadWriteLock()
        # One writer at a time, for a whole upsert/delete: this process's threads and other processes.
        self._write_guard = _storage.WriteGuard(Path(storage_dir) / _storage.WRITE_LOCK)
        self._read_only: Optional[str] = None  # why this object may not write or search the point store
        self._read_only_advice: Optional[str] = None  # what to do about it (None: IndexReadOnlyError's default)
        self._unindexed_hinted = False
        self._opened_read_only = False  # load(read_only=True): no shard, no lock, no write
        self._served_elsewhere: Optional[str] = None  # why this object may not write (load(qdrant_url=) of an embedded folder)
        self._serves_copy = False  # an embedded folder served from its server copy (load(qdrant_url=)): see _check_server_copy
        self._stale_copy_warned: Optional[int] = None  # the folder generation refresh() last warned its copy lacks
        self._write_start_snapshot: Any = None  # the BM25 state the running write started from
        self._vectors_checked = False  # the store's vectors compared with the embedding cache (once)

    @property
    def docstore(self) -> SimpleDocumentStore:
        """Every node of the index (parents too) by id, and each document's node ids: LlamaIndex's
        docstore (:class:`~.docstore.IndexDocumentStore`). Parsed from the committed file on first
        use after an open (queries never need it)."""
        docstore = self._docstore
        if docstore is None:
            with self._docstore_lock:
                if self._docstore is None:
                    self._docstore = self._docstore_loader()
                    self._docstore_loader = None
                docstore = self._docstore
        return docstore

    @docstore.setter
    def docstore(self, docstore: SimpleDocumentStore) -> None:
        self._set_docstore(docstore)

    def _set_docstore(self, docstore: Union[SimpleDocumentStore, Callable[[], SimpleDocumentStore]]) -> None:
        """A docstore, or a callable returning it, called on first use (``read_generation(defer_docstore=True)``)."""
        with self._docstore_lock:
            if isinstance(docstore, SimpleDocumentStore):
                self._docstore, self._docstore_loader = docstore, None
            else:
                self._docstore, self._docstore_loader = None, docstore

    @property
    def manifest(self) -> IndexManifest:
        """The index's ``index.json`` as this object knows it (typed, frozen; :mod:`.manifest`)."""
        return self._journal.manifest

    @property
    def config(self) -> Dict[str, Any]:
        """The manifest as the JSON object ``index.json`` holds (a copy: change the index through
        its methods, not this dict)."""
        return self._journal.manifest.to_json()

    @property
    def write_lock_timeout(self) -> Optional[float]:
        """Seconds a write (upsert, delete) waits for another process's write to the same folder
        before :class:`IndexWriteLockedError`: ``None`` means ``storage.DEFAULT_LOCK_TIMEOUT``
        (60 s), 0 no wait, ``math.inf`` no limit. Threads of this process always wait for each other."""
        return self._write_guard.timeout

    @write_lock_timeout.setter
    def write_lock_timeout(self, seconds: Optional[float]) -> None:
        if seconds is not None and (
            isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or math.isnan(seconds) or seconds < 0
        ):
            raise ValueError(f"write_lock_timeout must be None, a number of seconds >= 0 or math.inf, got {seconds!r}")
        self._write_guard.timeout = None if seconds is None else float(seconds)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_documents(
        cls,
        documents: Sequence[Document],
        storage_dir: str | Path,
        node_parser: Optional[NodeParser] = None,
        embed_model: Optional[BaseEmbedding] = None,
        tokenizer_config: Optional[BM25TokenizerConfig] = None,
        bm25_k1: float = 1.2,
        bm25_b: float = 0.75,
        qdrant_url: Optional[str] = None,
        qdrant_api_key: Optional[str] = None,
        embed_batch_size: int = 256,
        overwrite: bool = False,
        show_progress: bool = False,
        build_hnsw: bool = False,
        collection: Optional[str] = None,
        embedding_cache: Optional[str | Path] = None,
    ) -> "HybridIndex":
        """Chunk, embed and index ``documents`` into a new ``storage_dir``.

        ``overwrite=True`` replaces an existing index there; otherwise an existing index is an
        error (use :meth:`load` and :meth:`upsert`). ``embed_model`` defaults to LlamaIndex's
        ``Settings.embed_model`` when you set one, else the packaged offline MiniLM;
        ``node_parser`` to ``Settings.node_parser`` when you set one (``Settings.chunk_size`` /
        ``chunk_overlap`` set LlamaIndex's ``SentenceSplitter``), else :class:`SectionWindowNodeParser`.

        The index is built in a sibling folder (``.<name>.building``) and moved to
        ``storage_dir`` only when complete, so an interrupted or failed build leaves any previous
        index untouched and never a half-built one. Building again reuses the embeddings the
        interrupted build computed (and, with ``overwrite=True``, those of the replaced index that
        its chunks need: the replaced cache's other rows, e.g. of deleted documents, are not carried
        over, so a rebuild also purges the cache, see :meth:`purge`); ``embedding_cache`` names
        another cache file (an index's ``embeddings.sqlite``) whose vectors the build starts from
        (all of them copied; read, never changed).

        Only the index's own entries of ``storage_dir`` (``index.json``, ``edge/``, ``bm25/``,
        ``docstore/``, ``embeddings.sqlite``: :data:`.storage.INDEX_ENTRIES`) are ever replaced or
        deleted; the folder's other files (your documents, notes) stay where they are. A folder
        without an index that holds entries of those names is refused (ValueError) before anything
        is embedded, and so is a rebuild of an index open for writing in another process
        (:class:`IndexBusyError`): an open index that finds its folder rebuilt turns read-only.

        ``build_hnsw=True`` also builds the embedded engine's HNSW index before the folder is
        published (:meth:`optimize`, shown as a step of its own with ``show_progress``; ignored with
        ``qdrant_url=``, a server indexes on its own). Off by default: the default modes search the
        vectors exactly in memory and never use it, and it is most of the build time at scale (96 of
        224 s at 162k chunks, docs/benchmarks.md); only ``qdrant_hybrid`` and ``dense_search="qdrant"``
        use it, and they scan exactly without it.

        ``collection``: the collection name (letters, digits, '_', '-'; default ``"chunks"``, or the
        replaced index's). With ``qdrant_url``, the points go to a new collection ``<collection>-<12
        hex digits>`` marked with the index's id, served as ``collection`` (an alias) once the folder
        is published, when the collection it replaces is deleted (:class:`.store.ServerCollections`).
        A ``collection`` already on the server that is not the replaced index's own is refused
        (:class:`.store.ForeignCollectionError`): two indexes never share one.
        """
        _check_flag("build_hnsw", build_hnsw)
        storage = Path(storage_dir)
        if storage.is_symlink() or storage.name in ("", ".."):  # build next to the real folder
            storage = storage.resolve()
        # Before the model loads and anything is embedded (and again at publish, under the folder's lock).
        _storage.check_build_target(storage, overwrite)
        if (storage / _storage.MANIFEST).exists():  # a rebuild of an index open elsewhere: refused now, and at publish
            busy = cls._take_store_lock(storage)
            if busy is not None:
                busy.release()
        seed_cache = _check_embedding_cache(embedding_cache)
        if node_parser is None:
            node_parser = settings_node_parser()  # Settings.node_parser / chunk_size, when the user set them
            if node_parser is not None:
                logger.info("chunking with Settings.node_parser (%s)", type(node_parser).__name__)
        node_parser = node_parser or SectionWindowNodeParser()
        tokenizer_config = tokenizer_config or BM25TokenizerConfig()
        check_positive_int("embed_batch_size", embed_batch_size)
        bm25 = BM25Retriever([], tokenizer_config=tokenizer_config, k1=bm25_k1, b=bm25_b)  # checks k1 and b
        # A server that does not answer (or refuses the key, or holds another's collection) fails
        # here, before the embedding model loads.
        plan = cls._plan_collection(storage, collection, qdrant_url, qdrant_api_key, overwrite)
        embed_model = embed_model or settings_embed_model() or default_embed_model()
        manifest = IndexManifest(
            format_version=FORMAT_VERSION,
            embed_model=embed_model_name(embed_model),
            embed_model_class=embed_model.class_name(),
            embed_settings=embed_settings_of(embed_model),
            node_parser=node_parser.to_dict(),
            bm25=BM25Settings(k1=bm25_k1, b=bm25_b, method="lucene"),
            bm25_tokenizer=tokenizer_config.to_persisted(),
            qdrant_url=qdrant_url,
            collection=plan.collection,
            index_id=plan.index_id,
            embed_batch_size=embed_batch_size,
            build_id=new_build_id(),
        )
        build = _storage.building_dir(storage)
        build.mkdir(parents=True, exist_ok=True)
        guard = _storage.WriteGuard(build / _storage.WRITE_LOCK, timeout=0)  # one build per folder at a time
        with guard.hold():
            replaced_cache = _prepare_build_folder(build, storage, seed_cache)
            store = cls._open_store(build, manifest, qdrant_api_key)
            try:
                cache = _open_build_cache(build, replaced_cache)
            except BaseException:
                store.close()
                raise
            try:
                index = cls(build, manifest, embed_model, node_parser, store, bm25, IndexDocumentStore(), tokenizer_config, cache=cache)
            except BaseException:
                store.close()
                cache.close()
                raise
            index._write_guard = guard
            try:
                index._commit()  # generation 0: empty but valid
                index.upsert(documents, show_progress=show_progress)
                if build_hnsw:
                    index._optimize_store(show_progress)
                if not store.exists():
                    # No document gave a chunk: create the collection anyway (dimension from one probe
                    # embedding), so that every retriever mode answers [] instead of "not found".
                    index._ensure_collection(len(embed_model.get_text_embedding("dimension probe")))
                    index._journal.save(index.manifest)
                index._publish_build(storage, qdrant_api_key, overwrite)
                index._serve_build(plan)
            except BaseException:
                index.close()  # release the Qdrant lock: the caller never gets this object
                cls._drop_unpublished_collection(plan, storage, qdrant_api_key)
                raise
        guard.retarget(storage / _storage.WRITE_LOCK)
        guard.timeout = None  # the build's no-wait rule ends with the build: later writes wait as documented
        return index

    def _publish_build(self, storage: Path, qdrant_api_key: Optional[str], overwrite: bool) -> None:
        """Move this complete index from its build folder to ``storage`` and reopen it there.

        A missing ``storage`` is one rename. Into an existing folder (:func:`.storage.publish_into`:
        only index entries move, the replaced ones are deleted once the new index is in place), under
        the folder's write lock (a write of another process finishes first) and its store lock
        (:meth:`_lock_for_replacing`), the checks of :meth:`from_documents` are made again first:
        another build may have published there since (a ValueError without ``overwrite``).
        """
        self.store.close()
        self.cache.close()
        if not _storage.publish_new_folder(self.storage_dir, storage):
            locks = self._lock_for_replacing(storage)
            try:
                _storage.check_build_target(storage, overwrite)
                if os.name == "nt":  # Windows cannot rename a folder with an open file in it
                    for lock in locks:
                        lock.release()
                _storage.publish_into(self.storage_dir, storage, self.manifest.build_id or "")
            finally:
                for lock in reversed(locks):
                    lock.release()
        self.storage_dir = storage
        self._journal = WriteJournal(storage, self.manifest)
        self.cache = EmbeddingCache(storage / "embeddings.sqlite")
        self._vector_store = None
        self.store = self._open_store(storage, self.manifest, qdrant_api_key)
        self._finalizer.detach()
        self._finalizer = weakref.finalize(self, _close_quietly, self.store, self.cache)

    @staticmethod
    def _lock_for_replacing(storage: Path) -> List[_storage.FileLock]:
        """The locks a publish into the existing folder ``storage`` holds: the store lock of its
        embedded shard, with no wait (held, the index is open in another process, or another object
        of this one, that would write over the new index: an :class:`IndexBusyError`), then its
        write lock (waiting for a running write, up to ``storage.DEFAULT_LOCK_TIMEOUT``). An open
        index takes them in the same order."""
        store_lock = HybridIndex._take_store_lock(storage)
        write_lock = _storage.FileLock(storage / _storage.WRITE_LOCK)
        try:
            write_lock.acquire(_storage.DEFAULT_LOCK_TIMEOUT)
        except BaseException:
            if store_lock is not None:
                store_lock.release()
            raise
        return [write_lock] if store_lock is None else [store_lock, write_lock]

    @staticmethod
    def _take_store_lock(storage: Path) -> Optional[_storage.FileLock]:
        """The store lock of the embedded shard in ``storage`` (None: no shard there), taken with no
        wait; held elsewhere (the index is open there), an :class:`IndexBusyError` for a rebuild."""
        if not (storage / STORE_DIR).is_dir():
            return None
        lock = _storage.FileLock(storage / STORE_DIR / _store.STORE_LOCK)
        try:
            lock.acquire(timeout=0)
        except _storage.IndexWriteLockedError:
            raise IndexBusyError(storage, rebuilding=True) from None
        return lock

    @classmethod
    def load(
        cls,
        storage_dir: str | Path,
        embed_model: Optional[BaseEmbedding] = None,
        node_parser: Optional[NodeParser] = None,
        qdrant_api_key: Optional[str] = None,
        custom_tokenizer: Any = None,
        qdrant_url: Optional[str] = None,
        read_only: bool = False,
        show_progress: bool = False,
    ) -> "HybridIndex":
        """Open an index folder. The embedding model must be the one it was built with.

        ``embed_model`` defaults to ``Settings.embed_model`` when you set one that matches the
        index, else the packaged MiniLM. Its name must be the one ``index.json`` records, and its
        settings that change document vectors (``max_length``, ``normalize``, ...:
        :func:`.manifest.embed_settings_of`) the recorded ones: another configuration is an
        :class:`EmbedSettingsMismatchError` naming both (folders written before settings were
        recorded are not checked, and opening them records nothing: the opener's settings may
        not be the ones the vectors were made with).

        ``node_parser`` defaults to the one recorded in ``index.json``; one that chunks otherwise
        (``to_dict()`` differs) makes :meth:`upsert` refuse, naming both, since an index holds one
        chunking: rebuild with ``from_documents(..., overwrite=True)`` to change it.

        Nothing read here is unpickled (see the module docstring). A folder of the first format
        (Qdrant local mode in ``qdrant/``) is migrated to Qdrant Edge once, on this open, from its
        docstore and embedding cache, without reading ``qdrant/`` (deleted afterwards); chunks
        missing from the cache are embedded again. ``rkit migrate DIR`` does the same from the
        command line. ``show_progress=True`` shows that migration's progress on stderr (the chunks
        embedded again, then the points written), and that of the roll-back of an unfinished write
        (below: the points rewritten, every chunk's after a killed :meth:`purge`); an open that
        migrates and rolls back nothing shows nothing.

        ``qdrant_url`` serves an embedded folder from a Qdrant server its points were copied to
        with :meth:`push_to` (same results); such an object does not write (the folder's own
        points stay in ``edge/``): ``push_to(url, switch=True)`` moves the folder to the server
        for good. For a folder built with ``qdrant_url``, it names where the server moved to.
        A pushed copy is a snapshot: it is served only when it is a copy of the state the folder
        has committed (``push_to`` records it in the collection's metadata). One pushed before a
        later :meth:`upsert` or :meth:`delete`, changed on the server since, or pushed without that
        record (by an earlier version) is refused with :class:`StaleServerCopyError`, with
        ``read_only=True`` too: push the folder again (``index.push_to(url)``, ``rkit index ... --push
        URL``). Results then come from the folder's own chunks, looked up by point id.

        Before anything is used, every value of ``index.json`` is validated, the committed
        generation's BM25 and docstore files are checked against the sha256 recorded at commit
        (folders written before checksums load unverified until their next write), and the store's
        point count is compared with the BM25 index: a damaged folder is a
        :class:`~.storage.DamagedIndexError` (a ``ValueError``) naming the file and the rebuild
        command. An unfinished write is rolled back; when that cannot be written (disk full,
        read-only folder) the index opens read-only on the committed state, with a warning
        (dense search from the embedding cache; store-side search and writes raise
        :class:`~.storage.IndexReadOnlyError`), and a later writable open finishes the roll-back.

        ``read_only=True`` opens the committed index without taking anything: any number of
        processes can, also while one process has the folder open and writes to it (one writer, many
        readers). It never writes a file and never opens the Qdrant Edge shard: the BM25 leg and the
        exact dense leg answer (vectors from the embedding cache), so ``hybrid``, ``hybrid_score``,
        ``hybrid_rrf``, ``dense`` and ``sparse`` work and give the writer's answers; engine-side
        search (``qdrant_hybrid``, ``dense_search="qdrant"``) and writes raise
        :class:`~.storage.IndexReadOnlyError`. It keeps serving the generation it read until
        :meth:`refresh`. A Qdrant server (``qdrant_url``) is searched as usual, writes refused.

        A rebuild that another process publishes into the folder while this open reads it (its
        files go, or the new build's files replace the old ones under the same names) is never
        read half: the folder is opened again, on the new build; while the new build's files are
        still moving in, :class:`IndexBeingPublishedError` (retry shortly).
        """
        _check_flag("read_only", read_only)
        _check_flag("show_progress", show_progress)
        storage = Path(storage_dir)
        options = dict(embed_model=embed_model, node_parser=node_parser, qdrant_api_key=qdrant_api_key,
                       custom_tokenizer=custom_tokenizer, qdrant_url=qdrant_url, read_only=read_only, show_progress=show_progress)
        # A rebuild in another process may publish a new index while this open reads the old one
        # (files gone, or the new build's files read with the old index.json): opened again.
        for attempt in range(GENERATION_READ_ATTEMPTS):
            build_id = _disk_build_id(storage)
            try:
                index = cls._open(storage, **options)
            except (_storage.DamagedIndexError, _storage.IndexReadOnlyError, OSError):
                replaced = _replaced_while_read(storage, build_id)
                if replaced == "publishing":
                    raise IndexBeingPublishedError(storage) from None
                if replaced is None or attempt == GENERATION_READ_ATTEMPTS - 1:
                    raise
            else:
                replaced = _replaced_while_read(storage, index.manifest.build_id)
                if replaced is None:
                    return index
                index.close()
                if replaced == "publishing":
                    raise IndexBeingPublishedError(storage)
                if attempt == GENERATION_READ_ATTEMPTS - 1:
                    raise _storage.IndexReadOnlyError(storage, "the folder was rebuilt again and again while it was opened", REBUILT_ADVICE)
            logger.info("%s was rebuilt while it was opened; opening the new index", storage)
        raise AssertionError("unreachable")  # pragma: no cover

    @classmethod
    def _open(
        cls,
        storage: Path,
        embed_model: Optional[BaseEmbedding],
        node_parser: Optional[NodeParser],
        qdrant_api_key: Optional[str],
        custom_tokenizer: Any,
        qdrant_url: Optional[str],
        read_only: bool,
        show_progress: bool = False,
    ) -> "HybridIndex":
        """One attempt of :meth:`load` (its arguments, checked)."""
        manifest_file = storage / _storage.MANIFEST
        if not manifest_file.exists() and not read_only:
            _storage.resume_publish(storage)  # a rebuild killed while it moved the new index in: finished
        if _being_published(storage):  # a reader meets a rebuild's publish: its index.json comes last
            raise IndexBeingPublishedError(storage)
        if not manifest_file.exists():
            build = _storage.building_dir(storage)
            hint = (
                f" ({build} holds an interrupted build: build again, it reuses the embeddings computed so far)"
                if build.is_dir()
                else ""
            )
            raise ValueError(f"{storage} holds no index.json: build an index there with HybridIndex.from_documents first{hint}")
        manifest = IndexManifest.read(manifest_file, READABLE_FORMATS)
        served_elsewhere = None
        if qdrant_url is not None:
            if not isinstance(qdrant_url, str) or not qdrant_url.strip():
                raise ValueError(f"qdrant_url must be a non-empty str, got {qdrant_url!r}")
            if not manifest.qdrant_url:
                if manifest.pending is not None:
                    raise ValueError(
                        f"{storage} has an unfinished write: open it once without qdrant_url= (which rolls it back) "
                        "before serving it from a server"
                    )
                served_elsewhere = (
                    f"it is served from {qdrant_url} while its own points stay in {storage / STORE_DIR}; "
                    f"move it to the server for good with HybridIndex.push_to({qdrant_url!r}, switch=True)"
                )
            manifest = manifest.with_qdrant_url(qdrant_url)
        built_with = _describe_model(manifest.embed_model_class, manifest.embed_model)
        source = "the given embed_model"
        if embed_model is None:
            source = "Settings.embed_model"
            embed_model = settings_embed_model()  # LlamaIndex's Settings.embed_model, when the user set one
            if embed_model is not None and not _model_serves(manifest, embed_model):
                embed_model = None  # built with another model or settings: the default or a clear error below
                source = "the default model used as it comes (Settings.embed_model was not used: it does not match the index either)"
        if embed_model is None:
            if manifest.embed_model != DEFAULT_EMBED_MODEL:
                raise ValueError(
                    f"{storage} was built with embedding model {built_with}; pass "
                    f"embed_model= with that model to HybridIndex.load"
                )
            source = "the default model" if source == "Settings.embed_model" else source
            if not manifest.embed_settings_match({}):  # the default as it comes: refused before its weights load
                raise EmbedSettingsMismatchError(storage, manifest, {}, source)
            embed_model = default_embed_model()
        if embed_model_name(embed_model) != manifest.embed_model:
            given = _describe_model(embed_model.class_name(), embed_model_name(embed_model))
            raise ValueError(
                f"{storage} was built with embedding model {built_with}, not {given}: their vectors are "
                "not comparable. Load it with the model it was built with, or build a new index with this one"
            )
        given_settings = embed_settings_of(embed_model)
        if not manifest.embed_settings_match(given_settings):
            raise EmbedSettingsMismatchError(storage, manifest, given_settings, source)
        node_parser = node_parser or manifest.build_node_parser()
        manifest, verified, bm25, docstore = _read_committed(storage, manifest, custom_tokenizer, qdrant_url)
        legacy = manifest.format_version == 1 and not manifest.qdrant_url
        if legacy and served_elsewhere is not None:  # pragma: no cover - qdrant_url above
            raise ValueError(f"{storage} is in the old format: open it once without qdrant_url= to migrate it")
        if legacy and read_only:
            raise ValueError(
                f"{storage} is in the old index format (Qdrant local mode), which is migrated once by a writable "
                f"open: run `rkit migrate {storage}` (or HybridIndex.load without read_only=True) first"
            )
        if read_only and not manifest.qdrant_url:
            return cls._open_read_only(storage, manifest, embed_model, node_parser, bm25, docstore)
        shard_missing = bool(
            not legacy and manifest.qdrant_url is None and not (storage / STORE_DIR / _store.SCHEMA_FILE).exists() and len(bm25)
        )
        if shard_missing and not _rewrites_every_chunk(manifest, bm25):
            raise _storage.DamagedIndexError(storage / STORE_DIR, "is missing (the index holds chunks)", storage)
        # A format-1 folder starts its shard afresh (dropping what an interrupted migration left), and
        # so does one whose shard a killed purge() was rebuilding: the roll-back below rewrites every chunk.
        store = cls._open_store(storage, manifest, qdrant_api_key, fresh=legacy or shard_missing)
        try:
            index = cls(storage, manifest, embed_model, node_parser, store, bm25, docstore, bm25.tokenizer_config)
        except sqlite3.DatabaseError as exc:
            store.close()
            raise _unreadable_cache(storage, exc) from None
        index._served_elsewhere = served_elsewhere
        index._serves_copy = served_elsewhere is not None
        if read_only:  # a server's collection, searched as usual; nothing rolled back or written from here
            index._served_elsewhere = served_elsewhere or READ_ONLY_REASON
            index._opened_read_only = True
        if index._serves_copy:  # a copy of the folder: nothing of it is rolled back or written from here
            try:
                index._check_server_copy()
            except BaseException:
                index.close()
                raise
            return index
        if read_only:
            return index
        try:
            if legacy:
                index._migrate_from_local_mode(show_progress)
            index._finish_open(verified, show_progress)
        except BaseException:
            index.close()
            raise
        return index

    @classmethod
    def _open_read_only(
        cls, storage: Path, manifest: IndexManifest, embed_model: BaseEmbedding, node_parser: NodeParser, bm25: BM25Retriever, docstore: Any
    ) -> "HybridIndex":
        """An embedded folder opened with ``read_only=True`` (see :meth:`load`): no shard, no lock,
        no write; the embedding cache opened read-only."""
        error = _storage.IndexReadOnlyError(storage, READ_ONLY_REASON, READ_ONLY_ADVICE)
        try:
            cache = EmbeddingCache(storage / "embeddings.sqlite", read_only=True)
        except sqlite3.DatabaseError as exc:
            raise _unreadable_cache(storage, exc, read_only=True) from None
        index = cls(storage, manifest, embed_model, node_parser, _UnopenedStore(storage / STORE_DIR, error), bm25, docstore, bm25.tokenizer_config, cache=cache)
        index._read_only = READ_ONLY_REASON
        index._opened_read_only = True
        index._rw_lock = _storage.RefusingLock(error)
        return index

    def refresh(self) -> bool:
        """Serve the newest committed generation: re-read it when another process committed one
        since this object read its own (an index opened with ``read_only=True`` keeps the
        generation it read until then). Returns True when it moved. Cheap when nothing changed
        (``index.json`` read and compared), so a serving worker can call it before each request.
        A writable object catches up by itself before each write.

        An embedded folder served from a server copy (``load(dir, qdrant_url=)``) moves only to a
        generation the copy holds: while the folder has committed one that was not pushed yet, it
        keeps serving the generation it has (the copy's), logs a warning (once per generation)
        and returns False; after ``push_to`` it moves.

        A folder rebuilt since this object opened it is an :class:`~.storage.IndexReadOnlyError`
        (open it again), also when the rebuild is published while the new generation is read (never
        served half); one whose new build is still moving in, :class:`IndexBeingPublishedError`."""
        if self._read_only is None and self._served_elsewhere is None:  # a writer: under the write guard
            with self._write_guard.hold(), self._rw_lock.write():
                before = self.manifest.generation
                self._sync_with_disk()
                return self.manifest.generation != before
        try:
            disk = self._journal.read_disk()
        except FileNotFoundError:
            if _being_published(self.storage_dir):
                raise IndexBeingPublishedError(self.storage_dir) from None
            raise
        if disk.build_id != self.manifest.build_id:  # rebuilt: this object's files and cache are gone
            raise _storage.IndexReadOnlyError(self.storage_dir, "the folder was rebuilt since this object opened it", REBUILT_ADVICE)
        if disk.generation == self.manifest.generation:
            return False
        copy = self._server_copy_state() if self._serves_copy else None
        if self._serves_copy and not self._copy_holds(copy, disk):
            return False
        url = self.manifest.qdrant_url
        manifest = disk.with_qdrant_url(url) if url else disk
        try:
            manifest, _, committed, docstore = _read_committed(self.storage_dir, manifest, self.tokenizer_config.custom_tokenizer, url)
        except (_storage.DamagedIndexError, OSError):
            self._check_not_rebuilt()  # a rebuild began meanwhile: its files went
            raise
        self._check_not_rebuilt()  # and one that ended meanwhile: the new build's files may have been read
        if self._serves_copy and not self._copy_holds(copy, manifest):  # committed again while being read
            return False
        self._serve_generation(manifest, committed, docstore)
        logger.info("%s: now serving generation %d", self.storage_dir, manifest.generation)
        return True

    def _check_not_rebuilt(self) -> None:
        """Raise when another process's rebuild replaced this object's index (or is moving the new
        one in): :class:`IndexBeingPublishedError` or :class:`~.storage.IndexReadOnlyError`."""
        replaced = _replaced_while_read(self.storage_dir, self.manifest.build_id)
        if replaced == "publishing":
            raise IndexBeingPublishedError(self.storage_dir) from None
        if replaced == "rebuilt":
            raise _storage.IndexReadOnlyError(self.storage_dir, "the folder was rebuilt since this object opened it", REBUILT_ADVICE) from None

    def _serve_generation(self, manifest: IndexManifest, committed: BM25Retriever, docstore: Any) -> None:
        """Answer from a generation just read (``manifest``, its BM25 index and its docstore, or a
        callable parsing it): swapped in place, so retrievers made earlier (BM25 views) see it too.
        A dense matrix of the previous snapshot is not reused (:meth:`dense_matrix` keys it by
        snapshot)."""
        self.bm25.restore_snapshot(committed.snapshot)
        self._set_docstore(docstore)
        self._journal.amend(manifest)
        self._dense = None

    @staticmethod
    def _open_store(storage: Path, manifest: IndexManifest, api_key: Optional[str], fresh: bool = False) -> Any:
        """The point store of an index folder: the Edge shard in ``storage/edge`` or the server
        collection of ``manifest.qdrant_url``. A shard open elsewhere is an IndexBusyError; one
        the engine cannot read a DamagedIndexError naming it (``store.StoreDamagedError``); a
        server collection marked with another index's id a ``store.ForeignCollectionError``."""
        url = manifest.qdrant_url
        if url:
            store = _store.ServerPoints(server_client(url, api_key), manifest.collection, url=url, index_id=manifest.index_id)
            try:
                store.check_owner(storage)  # never serve another index's points with this folder's BM25 and docstore
            except BaseException:
                store.close()
                raise
            return store
        try:
            return _store.EdgePoints(storage / STORE_DIR, fresh=fresh)
        except _store.StoreBusyError:
            raise IndexBusyError(storage) from None

    def _migrate_from_local_mode(self, show_progress: bool = False) -> None:
        """Rebuild the points of a format-1 folder in Qdrant Edge, from the committed docstore and
        the embedding cache, without reading ``qdrant/`` (local mode pickles its points); then
        record format 2 and delete ``qdrant/``. Interrupted, it starts over on the next open.
        ``show_progress``: bars over the chunks embedded again and the points written."""
        storage = self.storage_dir
        with contextlib.ExitStack() as held:
            try:
                held.enter_context(self._write_guard.hold(timeout=0))
            except (_storage.IndexWriteLockedError, OSError) as exc:
                raise ValueError(
                    f"{storage} is in the old index format (Qdrant local mode) and is migrated once when opened, "
                    f"which needs write access and no other writer ({type(exc).__name__}: {exc}); "
                    f"when that is possible, run: rkit migrate {storage}"
                ) from None
            pending = self.manifest.pending
            if pending is not None:  # an unfinished write of the old format: its files go, the points are rebuilt below
                self._journal.discard_pending(pending)
            leaves = list(self.bm25.snapshot.nodes)
            before = len(self.cache)
            if leaves:
                self._write_leaves_from_cache(leaves, show_progress, "Migrating to Qdrant Edge")
            elif self.manifest.embed_dim:
                self._ensure_collection(self.manifest.embed_dim)
            self.store.flush()
            self._journal.save(self.manifest.with_format_version(FORMAT_VERSION))
            _storage.remove_path(storage / LEGACY_QDRANT_DIR)
            logger.warning(
                "%s: migrated to Qdrant Edge (%d chunk(s); %d embedded again, the rest from the embedding cache)",
                storage,
                len(leaves),
                len(self.cache) - before,
            )

    def close(self) -> None:
        """Release the point store (its lock) and the cache file (after a write running in
        another thread of this process has finished)."""
        with self._write_guard.hold_local():
            self.store.close()
            self.cache.close()
            self._finalizer.detach()

    def __enter__(self) -> "HybridIndex":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ writes
    @_exclusive_write
    def upsert(
        self, documents: Sequence[Document], show_progress: bool = False, allow_source_change: bool = False
    ) -> Dict[str, Any]:
        """Add or replace documents (by ``Document.id_``); unchanged chunks are not re-embedded.

        Re-indexing the same file replaces its chunks. A document whose id is already indexed
        for a *different* file (``metadata["file_path"]``, or ``source`` in folders built before
        ``file_path`` existed) or another ``metadata["source"]`` (a URL, a system's name:
        :func:`document_provenance`) is refused with :class:`DocumentIdConflictError`, since
        replacing it would silently drop the other document from the index; pass
        ``allow_source_change=True`` to replace it anyway (e.g. a file that moved). A document
        whose provenance is unknown on either side (no ``file_path``, no ``source``) replaces the
        indexed one of its id: that is what an upsert by id means.

        Chunks are identified by node id (:mod:`~..retrievers.node_identity`): a chunk id that two
        documents of the batch produce, or that an indexed document outside the batch already holds
        (e.g. two Documents with different ids sharing ``metadata["doc_id"]``, one per page), is
        refused with :class:`ChunkIdConflictError` before anything is written, since writing it would
        silently replace the other document's chunk. A ``node_parser`` that chunks otherwise than
        the one the index was built with (``index.json``; compared by ``to_dict()``) is refused
        too: rebuild with ``from_documents(..., overwrite=True)`` (``rkit index --rebuild``).

        Returns counts: ``documents``, ``chunks`` written, ``removed`` (stale chunks), ``embedded``
        (texts embedded), and ``empty``: the ids of the documents that gave no chunk (e.g. only
        whitespace), logged as a warning; their earlier chunks are removed and they are not in
        :meth:`doc_ids` (a replace by nothing).

        A copy pushed to a server (:meth:`push_to`) is a snapshot and still holds the old text:
        push again before serving it; until then ``load(dir, qdrant_url=)`` refuses it
        (:class:`StaleServerCopyError`) and serving workers keep the pushed generation.
        """
        self._check_node_parser()
        self._check_embed_model()
        documents = list(documents)
        for doc in documents:
            check_document_text(doc)
        ids = [d.id_ for d in documents]
        check_unique_document_ids(documents)
        if not allow_source_change:
            conflicts = [
                (doc.id_, old, new)
                for doc in documents
                for old, new in [(self._indexed_provenance(doc.id_), document_provenance(doc.metadata))]
                if old is not None and new is not None and old != new
            ]
            if conflicts:
                raise DocumentIdConflictError(conflicts, self.storage_dir)
        nodes = self.node_parser.get_nodes_from_documents(documents, show_progress=show_progress)
        record_document_ids(nodes)  # a parser that leaves metadata["doc_id"] out: filters on it still work
        leaves = get_leaf_nodes(nodes) if any(n.child_nodes for n in nodes) else nodes
        old_ids = set()
        for doc_id in ids:
            old_ids.update(self._node_ids_of(doc_id))
        new_ids = {n.node_id for n in nodes}
        self._check_chunk_owners(nodes, ids, old_ids)
        stale = old_ids - new_ids
        cached_before = len(self.cache)
        vectors = embed_texts(
            self.embed_model,
            [n.get_content(metadata_mode=MetadataMode.EMBED) for n in leaves],
            self.cache,
            batch_size=self.manifest.embed_batch_size,
            show_progress=show_progress,
        )
        embedded = len(self.cache) - cached_before
        self._ensure_collection(vectors.shape[1] if len(leaves) else None)
        # Points deleted or replaced: the shard is reloaded at commit (IDF statistics); only new ones: flushed.
        reload_store = bool(old_ids) or any(self.docstore.document_exists(i) for i in new_ids)

        with self._rw_lock.write():  # queries reading the store wait: they see before or after
            self._begin(sorted(old_ids | new_ids))
            try:
                tokens = self._write_points(leaves, vectors) if leaves else None
                if stale:
                    self.store.delete_points([_store.point_id(i) for i in sorted(stale)])
                # BM25: every indexed node of these documents replaced, emptied ones included (one rebuild).
                self.bm25.replace_documents(leaves, tokens=tokens, doc_ids=ids)
                for doc_id in ids:
                    self.docstore.delete_ref_doc(doc_id, raise_error=False)
                self.docstore.add_documents(nodes, allow_update=True)
                self._commit(reload_store=reload_store)
            except BaseException:
                self._recover()
                raise
        logger.info("upserted %d documents: %d chunks, %d stale removed, %d embedded", len(ids), len(nodes), len(stale), embedded)
        chunked = {n.ref_doc_id for n in nodes}
        empty = [doc_id for doc_id in ids if doc_id not in chunked]
        if empty:
            logger.warning(
                "%d document(s) gave no chunks (no text to index) and are not in the index (any earlier chunks of "
                "theirs were removed): %s",
                len(empty),
                ", ".join(map(repr, empty)),
            )
        return {"documents": len(ids), "chunks": len(nodes), "removed": len(stale), "embedded": embedded, "empty": empty}

    def _check_embed_model(self) -> None:
        """Refuse to embed with another model, or other document-vector settings, than the index
        records (one kind of vector per index): ``index.embed_model`` replaced or reconfigured
        since :meth:`load`, which checked it."""
        if embed_model_name(self.embed_model) != self.manifest.embed_model:
            built_with = _describe_model(self.manifest.embed_model_class, self.manifest.embed_model)
            given = _describe_model(self.embed_model.class_name(), embed_model_name(self.embed_model))
            raise ValueError(
                f"{self.storage_dir} was built with embedding model {built_with}, but index.embed_model is {given}: "
                "their vectors are not comparable. Upsert with the model it was built with, or rebuild the index with this one"
            )
        settings = embed_settings_of(self.embed_model)
        if not self.manifest.embed_settings_match(settings):
            raise EmbedSettingsMismatchError(self.storage_dir, self.manifest, settings, "index.embed_model")

    def _check_node_parser(self) -> None:
        """Refuse to chunk with another parser than the index was built with (two chunkings in one
        index, and ``index.json`` naming only the first)."""
        changes = node_parser_changes(self.manifest.node_parser, self.node_parser.to_dict())
        if changes:
            raise ValueError(
                f"{self.storage_dir} was built with another chunking than this index's node_parser: {'; '.join(changes)}. "
                "An index holds one chunking: open it without node_parser= (or with the one it was built with) to "
                "update it, or rebuild it with the new parser: HybridIndex.from_documents(..., overwrite=True) "
                "(rkit index --rebuild)"
            )

    def _check_chunk_owners(self, nodes: Sequence[BaseNode], doc_ids: Sequence[str], old_ids: set) -> None:
        """Refuse chunk ids that two documents would share (:class:`ChunkIdConflictError`): two of
        the batch's documents, or one of them and an indexed document outside the batch."""

        def owner_of(node_id: str) -> Optional[str]:
            if node_id in old_ids or self.docstore.get_document_hash(node_id) is None:
                return None  # a node of a document in this batch, or not indexed
            node = self.docstore.get_node(node_id, raise_error=False)
            return None if node is None else node.ref_doc_id

        check_chunk_ids(nodes, owner_of, replaced_docs=set(doc_ids))

    @_exclusive_write
    def delete(self, doc_id: str) -> int:
        """Remove a document's chunks from every leg of this folder; returns how many were removed.

        A copy pushed to a server (:meth:`push_to`) is a snapshot and still holds the document:
        push again before serving it; until then ``load(dir, qdrant_url=)`` refuses it
        (:class:`StaleServerCopyError`) and serving workers keep the pushed generation.
        """
        if not isinstance(doc_id, str):
            raise TypeError(
                f"delete takes one document id (a str), got {type(doc_id).__name__} {doc_id!r}: "
                "for several, call delete for each (index.doc_ids() lists them)"
            )
        node_ids = sorted(self._node_ids_of(doc_id))
        if not node_ids:
            raise ValueError(f"no document {doc_id!r} in {self.storage_dir} (known ids: {self.doc_ids()[:10]}...)")
        with self._rw_lock.write():
            self._begin(node_ids)
            try:
                self.store.delete_points([_store.point_id(i) for i in node_ids])
                self.bm25.delete_ref_doc(doc_id)
                self.docstore.delete_ref_doc(doc_id, raise_error=False)
                self._commit()
            except BaseException:
                self._recover()
                raise
        return len(node_ids)

    @_exclusive_write
    def optimize(self, show_progress: bool = False) -> bool:
        """Build the embedded engine's HNSW index over every stored point (Qdrant Edge's segment
        optimisers, run until none is planned: HNSW for segments above Edge's indexing threshold,
        about 6,700 384-d vectors; smaller ones are scanned, which is as fast). True when it changed
        anything.

        Only ``qdrant_hybrid`` and ``dense_search="qdrant"`` search with HNSW; without it Edge scans
        the vectors exactly (about 2.6 ms per dense query at 32k chunks, growing linearly; 1.0 ms
        with HNSW, ``benchmarks/scale_index.py``). Points added by :meth:`upsert` later are scanned
        until the next call. Takes about 0.6 ms per 384-d vector on 2 cores (minutes at 100k+
        chunks) and holds the write lock meanwhile; queries of this process wait. Nothing changes
        what any query returns, apart from HNSW being approximate. A server indexes in the
        background on its own: there it does nothing and returns False. Also ``rkit index --hnsw``.

        ``show_progress=True`` shows the step on stderr. The build is one call into Qdrant Edge that
        reports no progress (and holds the GIL), so there is no count or estimate to show: a line
        names the step while it runs and gives its elapsed time once it returns.
        """
        _check_flag("show_progress", show_progress)
        return self._optimize_store(show_progress)

    def _optimize_store(self, show_progress: bool = False) -> bool:
        started = time.perf_counter()
        with self._rw_lock.write(), _opaque_step(show_progress and self.store.kind == "edge", HNSW_STEP):
            changed = self.store.optimize()
        logger.info(
            "%s: engine optimised in %.1f s (%s)",
            self.storage_dir,
            time.perf_counter() - started,
            "segments optimised" if changed else "nothing to do",
        )
        return changed

    @_exclusive_write
    def purge(self, show_progress: bool = False) -> Dict[str, int]:
        """Erase from the folder what the committed index no longer holds: the text, metadata and
        vectors of deleted and replaced chunks. :meth:`delete` and :meth:`upsert` take them out of
        every query path, but Qdrant Edge keeps their payloads in its WAL and segment pages (seen
        after 14,000 later point writes, :meth:`optimize` and reopens), and the embedding cache keeps
        each removed chunk's text hash and vector. For an erasure request: delete, then purge.

        1. The Edge shard is written afresh from the committed chunks (the docstore's leaves), their
           vectors from the embedding cache (one it lacks is first copied there from the old
           shard: nothing is embedded), with the old shard's payload indexes and, when it had
           one, HNSW; the old shard's files are deleted. Crash-safe through the write journal:
           ``index.json`` records the write as touching every chunk before the old shard goes, so
           a kill at any point leaves a folder that opens to the same committed index (the open
           rewrites the points from the cache, as after any interrupted write). The generation
           does not change: a copy pushed of this state stays current.
        2. The embedding cache keeps only the index model's vectors of the committed chunks
           (:meth:`.embedding_cache.EmbeddingCache.retain`, with SQLite's ``secure_delete``), and
           is rewritten (``VACUUM``).

        Returns ``points`` (written to the new shard), ``cache_rows_removed``, ``cache_rows`` (kept)
        and ``bytes_freed`` (allocated bytes of ``edge/`` and ``embeddings.sqlite``, before minus
        after; negative when the new shard takes more, e.g. a rebuilt HNSW). A write like
        :meth:`delete` (the write lock, held throughout; an index open elsewhere cannot be opened
        to purge: :class:`IndexBusyError`); about as long as writing every chunk again, plus the
        HNSW build when there is one; queries of this process that read the shard wait meanwhile.

        Only this folder is purged: a copy pushed to a server (:meth:`push_to`) keeps deleted text
        until you push again (which deletes the previous copy there), and the server keeps its own
        WAL and snapshots; an interrupted build's ``.<name>.building`` beside the folder keeps its
        own cache (a warning names it). The file system reuses the freed blocks as usual: nothing
        overwrites the disk itself. ``rkit purge --storage DIR`` runs this.

        ``show_progress=True`` shows it on stderr step by step: a bar over the points written to the
        new shard, then a line for each step that is one opaque call reporting no progress of its
        own (vectors the cache lacks read from the old shard; Edge's HNSW build; the cache's DELETE
        and VACUUM), naming it while it runs and giving its elapsed time once done.
        """
        _check_flag("show_progress", show_progress)
        if self.store.kind != "edge":
            raise ValueError(
                f"{self.storage_dir} lives on {self.store.location}; purge() rewrites the embedded shard. On a server, "
                "rebuild the index (HybridIndex.from_documents(..., qdrant_url=..., overwrite=True)): it writes a new "
                "collection, deletes the replaced one and takes only its own chunks' vectors from the embedding cache"
            )
        cache_file = self.storage_dir / "embeddings.sqlite"
        before = _disk_usage(self.storage_dir / STORE_DIR) + _disk_usage(cache_file)
        leaves = list(self.bm25.snapshot.nodes)
        model = model_key(self.embed_model)
        keys = [text_key(n.get_content(metadata_mode=MetadataMode.EMBED)) for n in leaves]
        copied = self._cache_vectors_from_store(leaves, keys, model, show_progress)
        with self._rw_lock.write():  # queries reading the shard wait: it is gone until rewritten
            self._rewrite_store(leaves, show_progress)
        with _opaque_step(show_progress, "Purging: cleaning the embedding cache (SQLite DELETE and VACUUM)"):
            removed = self.cache.retain(model, keys)
            self.cache.vacuum()
        stats = {
            "points": self.store.count(),
            "cache_rows_removed": removed,
            "cache_rows": len(self.cache),
            "bytes_freed": before - _disk_usage(self.storage_dir / STORE_DIR) - _disk_usage(cache_file),
        }
        logger.info(
            "%s: purged: the shard rewritten with %d point(s) (%d vector(s) copied from the old shard to the cache), "
            "%d cached vector(s) of removed chunks deleted, %d bytes freed",
            self.storage_dir, stats["points"], copied, removed, stats["bytes_freed"],
        )
        build = _storage.building_dir(self.storage_dir)
        if build.is_dir():
            logger.warning(
                "%s holds an interrupted build of this folder, with its own embedding cache, which purge() does not "
                "touch: build again to finish it, or delete that folder",
                build,
            )
        return stats

    def _cache_vectors_from_store(self, leaves: Sequence[BaseNode], keys: Sequence[str], model: str, show_progress: bool = False) -> int:
        """Copy into the embedding cache the stored vectors of the ``leaves`` (text keys ``keys``)
        it lacks, so that rewriting the points embeds nothing; returns how many."""
        missing = set(self.cache.missing(model, keys))
        if not missing or not self.store.exists():
            return 0
        wanted = {_store.point_id(n.node_id): key for n, key in zip(leaves, keys) if key in missing}
        with _opaque_step(show_progress, "Purging: copying the vectors the embedding cache lacks from the shard"):
            point_ids, vectors = self.store.dense_block()
            rows = {wanted[pid]: vectors[i] for i, pid in enumerate(point_ids) if pid in wanted}
            self.cache.put_many(model, rows.items())
        return len(rows)

    def _rewrite_store(self, leaves: Sequence[BaseNode], show_progress: bool = False) -> None:
        """:meth:`purge`'s step 1, under the write locks: journal a write touching every chunk,
        replace the shard by a fresh one holding the committed ``leaves`` (vectors from the cache,
        the old payload indexes, HNSW when the old shard had it), then clear the journal as a
        finished roll-back does (the committed generation is unchanged). A failure is rolled
        back like a failed write (:meth:`_recover`: every point rewritten)."""
        store = self.store
        had_shard = store.exists()
        indexes = store.payload_indexes if had_shard else {}
        points = store.count() if had_shard else 0
        had_hnsw = bool(points) and store.unindexed_vectors() < points
        self._begin([n.node_id for n in leaves])
        pending = self._journal.pending
        assert pending is not None
        try:
            store.clear()
            if self.manifest.embed_dim:
                self._ensure_collection(self.manifest.embed_dim)
                store.ensure_payload_indexes(indexes)
            self._write_leaves_from_cache(leaves, show_progress, "Purging: rewriting the shard")
            if had_hnsw:
                with _opaque_step(show_progress, HNSW_STEP):
                    store.optimize()
            store.refresh()  # exact IDF statistics; the engine drops the segments the optimiser replaced
            schema = self.storage_dir / STORE_DIR / _store.SCHEMA_FILE
            if schema.exists():  # durable before the journal stops covering the new shard
                _storage.fsync_tree(schema)
            self._journal.finish_roll_back(pending)
        except BaseException:
            self._recover()
            raise
        self._write_start_snapshot = None
        self._dense = None
        self._vectors_checked = False

    def _node_ids_of(self, doc_id: str) -> List[str]:
        info = self.docstore.get_ref_doc_info(doc_id)
        return list(info.node_ids) if info else []

    def _indexed_metadata(self, doc_id: str) -> Optional[Dict[str, Any]]:
        """The metadata of an indexed document's first chunk (None: not indexed)."""
        for node_id in self._node_ids_of(doc_id):
            node = self.docstore.get_node(node_id, raise_error=False)
            if node is not None:
                return node.metadata
        return None

    def _indexed_origin(self, doc_id: str) -> Optional[str]:
        """The file an indexed document came from (see :func:`document_origin`), if known."""
        metadata = self._indexed_metadata(doc_id)
        return document_origin(metadata) if metadata is not None else None

    def _indexed_provenance(self, doc_id: str) -> Optional[str]:
        """Where an indexed document came from (see :func:`document_provenance`), if known."""
        metadata = self._indexed_metadata(doc_id)
        return document_provenance(metadata) if metadata is not None else None

    def document_origins(self) -> Dict[str, Optional[str]]:
        """Each indexed document id with the absolute path of the file it came from (None if unknown)."""
        return {doc_id: self._indexed_origin(doc_id) for doc_id in self.doc_ids()}

    def push_to(
        self,
        qdrant_url: str,
        api_key: Optional[str] = None,
        collection: Optional[str] = None,
        overwrite: bool = False,
        switch: bool = False,
        show_progress: bool = False,
    ) -> int:
        """Copy this embedded index's points (vectors and payloads, as stored) to a Qdrant server or
        cluster, served there as ``collection`` (default: the index's, ``manifest.collection``), with
        the same schema; returns how many were copied.

        The points go to a new collection ``<collection>-<12 hex digits>``, marked with the index's id
        (``index.json``'s ``index_id``) in its metadata; once it holds them all, the alias
        ``collection`` names it in one step (readers see the previous copy or this one) and the
        previous copy is deleted (:class:`.store.ServerCollections`). So pushing again replaces the
        index's own copy. A ``collection`` this index did not write (another index's, another
        application's, or a copy pushed before index ids) is refused with a
        :class:`.store.ForeignCollectionError` naming it, unless ``overwrite=True`` (``rkit index
        --push URL --push-overwrite``): then a plain collection of that name is deleted, while
        another index's collection behind the alias is left in place and only the alias moves.
        Recognising its own collection needs Qdrant 1.16 or later (collection metadata).

        Afterwards ``HybridIndex.load(storage_dir, qdrant_url=qdrant_url)`` serves the same results
        from the server (read-only there). The copy is a snapshot of the folder's committed state,
        which it records in its metadata beside the index id (:attr:`.manifest.IndexManifest.folder_state`:
        build, generation, checksums): a later :meth:`upsert` or :meth:`delete` does not reach it,
        and ``load(dir, qdrant_url=)`` refuses it from then on (:class:`StaleServerCopyError`) until
        you push again; serving workers keep their generation until then (:meth:`refresh`).
        ``switch=True`` moves the folder to the server for good:
        ``index.json`` records the server and the new collection, this object writes there from now
        on and ``edge/`` is deleted (that collection records no snapshot state: it is the index).
        Qdrant Edge's snapshots are the other route (see docs/architecture.md).
        ``show_progress``: a progress bar over the points copied.
        """
        if self.store.kind != "edge":
            raise ValueError(f"{self.storage_dir} already lives on {self.store.location}; push_to copies an embedded index")
        if not isinstance(qdrant_url, str) or not qdrant_url.strip():
            raise ValueError(f"qdrant_url must be a non-empty str, got {qdrant_url!r}")
        for flag, value in (("overwrite", overwrite), ("switch", switch), ("show_progress", show_progress)):
            _check_flag(flag, value)
        name = check_collection_name(collection if collection is not None else self.manifest.collection, served=True)
        if switch and name != self.manifest.collection:
            raise ValueError("switch=True keeps the index's collection name: leave collection= unset")
        self._check_writable()
        if not self.manifest.embed_dim:
            raise ValueError(f"{self.storage_dir} holds no vectors yet (nothing was embedded): nothing to push")
        client = server_client(qdrant_url, api_key)
        names = _store.ServerCollections(client, qdrant_url)
        switched = False
        try:
            with self._write_guard.hold():
                index_id = self._ensure_index_id()
                current = names.target(name)
                if current is not None and not overwrite and names.owner(current) != index_id:
                    raise self._foreign(names, name, current, PUSH_OVERWRITE_ADVICE)
                # A copy records the folder state it holds (load(dir, qdrant_url=) serves it only while the
                # folder is in that state); a switched-to collection is the index itself, written from now on.
                state = None if switch else self.manifest.folder_state.to_json()
                target = _store.ServerPoints(client, _store.build_collection_name(name), url=qdrant_url, index_id=index_id, folder_state=state)
                try:
                    with self._rw_lock.read():
                        copied = self._copy_points(target, show_progress)
                    self._take_name(names, name, target.collection, index_id, None, overwrite, PUSH_OVERWRITE_ADVICE)
                except BaseException:
                    self._delete_quietly(names, target.collection)
                    raise
                if switch:
                    with self._rw_lock.write():
                        previous = self.manifest
                        try:
                            self._journal.save(self.manifest.with_qdrant_url(qdrant_url, target.collection))
                        except BaseException:
                            # index.json still names the shard (or, written but not fsynced, may not:
                            # the next write's sync with the disk refuses then); this object keeps it.
                            self._journal.amend(previous)
                            raise
                        old, self.store = self.store, target
                        switched = True
                        self._finalizer.detach()
                        self._finalizer = weakref.finalize(self, _close_quietly, self.store, self.cache)
                        self._vector_store = None
                        old.close()
                        _storage.remove_path(self.storage_dir / STORE_DIR)
        finally:
            if not switched:
                client.close()
        logger.info(
            "%s: copied %d point(s) to %s as %r%s", self.storage_dir, copied, qdrant_url, name, " and switched to it" if switch else ""
        )
        return copied

    def _copy_points(self, target: Any, show_progress: bool = False) -> int:
        """Copy every stored point into the new server collection ``target``; returns how many."""
        target.create(self.manifest.embed_dim)
        copied = 0
        batch: List[Any] = []
        bar = _progress_bar(show_progress, "Pushing", total=len(self.bm25), unit="point")
        try:
            for point in self.store.iter_points():
                batch.append(point)
                if len(batch) >= _store.SERVER_UPSERT_BATCH:
                    copied += self._copy_batch(target, batch)
                    if bar is not None:
                        bar.update(len(batch))
                    batch = []
            copied += self._copy_batch(target, batch)
            if bar is not None:
                bar.update(len(batch))
        finally:
            if bar is not None:
                bar.close()
        if target.count() != len(self.bm25):
            raise RuntimeError(f"{target.location} holds {target.count()} point(s) after the copy, the index {len(self.bm25)}")
        target.ensure_payload_indexes(self.store.payload_indexes)  # the shard's, for the same filters
        return copied

    @staticmethod
    def _copy_batch(target: Any, points: Sequence[Any]) -> int:
        if points:
            target.upsert_points(
                [p.point_id for p in points], np.array([p.dense for p in points], dtype=np.float32), [p.sparse for p in points], [p.payload for p in points]
            )
        return len(points)

    def _ensure_index_id(self) -> str:
        """The index's id; a folder written before ids gets one now (saved in ``index.json``; under the write guard)."""
        if self.manifest.index_id is None:
            self._journal.save(self.manifest.with_index_id(new_index_id()))
        return str(self.manifest.index_id)

    @classmethod
    def _plan_collection(
        cls, storage: Path, collection: Optional[str], qdrant_url: Optional[str], api_key: Optional[str], overwrite: bool
    ) -> CollectionPlan:
        """Where a build writes, checked before anything is embedded. The index id and (without
        ``collection``) the name are the replaced index's (``overwrite=True``), else new / ``"chunks"``.
        On a server, the name must be free, or name the replaced index's own collection or one marked
        with its id; anything else is a :class:`.store.ForeignCollectionError`."""
        if qdrant_url is not None and (not isinstance(qdrant_url, str) or not qdrant_url.strip()):
            raise ValueError(f"qdrant_url must be a non-empty str or None, got {qdrant_url!r}")
        old = _replaced_manifest(storage) if overwrite else None
        index_id = old.index_id if old is not None and old.index_id else new_index_id()
        if collection is None:
            name = _store.served_collection_name(old.collection) if old is not None else COLLECTION
        else:
            name = check_collection_name(collection, served=bool(qdrant_url))
        if not qdrant_url:
            return CollectionPlan(name, name, index_id, None, None)
        name = check_collection_name(name, served=True)
        client = server_client(qdrant_url, api_key)
        try:
            names = _store.ServerCollections(client, qdrant_url)
            replaced = _own_server_collection(names, old, qdrant_url, index_id)
            current = names.target(name)
            if current is not None and current != replaced and names.owner(current) != index_id:
                raise cls._foreign(names, name, current, BUILD_FOREIGN_ADVICE)
        finally:
            client.close()
        return CollectionPlan(name, _store.build_collection_name(name), index_id, qdrant_url, replaced)

    def _serve_build(self, plan: CollectionPlan) -> None:
        """After a server build is published: serve it as ``plan.name`` and delete the collections
        of the index it replaced (:meth:`_take_name`). The folder is complete either way: a failure
        here leaves the alias on the previous collection, with a warning."""
        if plan.url is None or self.store.kind != "server":
            return
        names = _store.ServerCollections(self.store.client, plan.url)
        try:
            self._take_name(names, plan.name, plan.collection, plan.index_id, plan.replaced, False, BUILD_FOREIGN_ADVICE)
        except Exception as exc:  # noqa: BLE001 - reported; the published index is whole
            logger.warning(
                "%s: the index is built in Qdrant collection %r at %s, but %r could not be pointed at it (%s: %s); "
                "its own queries are unaffected, readers of %r are not served it until it is built or pushed again",
                self.storage_dir, plan.collection, plan.url, plan.name, type(exc).__name__, exc, plan.name,
            )

    @classmethod
    def _take_name(
        cls,
        names: "_store.ServerCollections",
        name: str,
        collection: str,
        index_id: str,
        replaced: Optional[str],
        overwrite: bool,
        advice: str,
    ) -> None:
        """Serve the complete ``collection`` as ``name`` (an alias, switched in one step), then delete
        what it replaces: the collection ``name`` named when it was this index's (marked with
        ``index_id``, or ``replaced``), earlier build collections of ``name`` marked with
        ``index_id`` (left by an interrupted build or push), and ``replaced``. Another index's or
        application's collection is refused (:class:`.store.ForeignCollectionError`) unless
        ``overwrite``: then a plain collection ``name`` is deleted, one behind the alias kept."""
        current = names.target(name)
        if current != collection:
            ours = current is not None and (current == replaced or names.owner(current) == index_id)
            if current is not None and not ours and not overwrite:
                raise cls._foreign(names, name, current, advice)
            if current == name:  # a plain collection: it must go before the alias can take its name
                names.delete(name)
            names.serve(name, collection)
            if current is not None and current != name:
                if ours:
                    names.delete(current)
                else:
                    logger.warning("%r at %s now names %r; %r, which it named before, is not this index's and was left in place", name, names.url, collection, current)
        for leftover in names.builds_of(name, index_id):
            if leftover != collection:
                names.delete(leftover)
        if replaced is not None and replaced not in (collection, current) and names.target(replaced) == replaced:
            names.delete(replaced)

    @staticmethod
    def _foreign(names: "_store.ServerCollections", name: str, current: str, advice: str) -> "_store.ForeignCollectionError":
        """The error for ``name`` (naming ``current``) when this index may not replace it."""
        return _store.ForeignCollectionError(name, names.url, names.owner(current), names.count(current), advice, alias_of=current)

    @staticmethod
    def _delete_quietly(names: "_store.ServerCollections", collection: str) -> None:
        """Delete a collection this index was writing when that failed (best effort, logged)."""
        try:
            if names.target(collection) == collection:
                names.delete(collection)
        except Exception:  # noqa: BLE001 - the original error matters more
            logger.warning("could not delete the unfinished Qdrant collection %r at %s; delete it by hand", collection, names.url, exc_info=True)

    @classmethod
    def _drop_unpublished_collection(cls, plan: CollectionPlan, storage: Path, api_key: Optional[str]) -> None:
        """After a failed server build: delete its new collection unless ``storage`` was published
        with it (a failure after the folder moved in keeps it)."""
        if plan.url is None:
            return
        try:
            published = IndexManifest.read(storage / _storage.MANIFEST, READABLE_FORMATS).collection == plan.collection
        except Exception:  # noqa: BLE001 - no index there (or unreadable): not published
            published = False
        if published:
            return
        try:
            client = server_client(plan.url, api_key)
        except Exception:  # noqa: BLE001
            logger.warning("could not reach %s to delete the unfinished collection %r", plan.url, plan.collection, exc_info=True)
            return
        try:
            names = _store.ServerCollections(client, plan.url)
            if names.target(plan.collection) == plan.collection and names.owner(plan.collection) == plan.index_id:
                cls._delete_quietly(names, plan.collection)
        except Exception:  # noqa: BLE001
            logger.warning("could not delete the unfinished collection %r at %s", plan.collection, plan.url, exc_info=True)
        finally:
            client.close()

    def doc_ids(self) -> List[str]:
        """The ids of the indexed documents."""
        return sorted((self.docstore.get_all_ref_doc_info() or {}).keys())

    def _ensure_collection(self, dim: Optional[int]) -> None:
        """Create the point store's collection at the first write (dimension ``dim``); an existing
        one is this index's (checked on open, ``store.ServerPoints.check_owner``)."""
        if self.store.exists():
            if dim is not None and self.manifest.embed_dim not in (None, dim):
                raise ValueError(f"embedding dimension {dim} differs from the index's {self.manifest.embed_dim}")
            return
        if dim is None:
            return
        if self.store.kind == "server" and self.manifest.embed_dim is not None:
            # created once, at the first write: never recreate it under a folder that used it
            raise _storage.DamagedIndexError(
                self.store.location, "is gone (deleted on the server, or replaced by a rebuild of the folder)", self.storage_dir
            )
        self.store.create(dim)
        self._journal.amend(self.manifest.with_embed_dim(dim))

    def _write_points(
        self, leaves: Sequence[BaseNode], vectors: Any, tokens: Optional[List[List[str]]] = None, progress: Optional[Callable[[int], None]] = None
    ) -> List[List[str]]:
        """Write the points of ``leaves``; returns their BM25 tokens (computed once, shared with BM25).
        ``progress`` is called with the number of points of each batch written (a bar's ``update``)."""
        # Unit-length vectors: cosine does not care, and the dense matrix read back from any
        # transport then scores like the engine (Qdrant local mode, for one, normalised on upsert
        # but not when it reloaded a collection from disk).
        vectors = np.asarray(vectors, dtype=np.float32)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.where(norms > 0, norms, 1.0)
        if tokens is None:
            tokens = [self.bm25.node_tokens(n) for n in leaves]
        bm25cfg = self._bm25_settings(tokens)
        reporting = {} if progress is None else {"progress": progress}  # a store's upsert_points may take only the points
        self.store.upsert_points(
            [_store.point_id(node.node_id) for node in leaves],
            vectors,
            _store.bm25_sparse_parts(tokens, bm25cfg["avgdl"], bm25cfg["k1"], bm25cfg["b"], term_id=token_id),  # = bm25_doc_vector
            [_store.node_payload(node) for node in leaves],  # QdrantVectorStore layout + filter bookkeeping
            **reporting,
        )
        return tokens

    def _bm25_settings(self, tokens: Sequence[Sequence[str]]) -> Dict[str, Any]:
        """The index's BM25 parameters (k1, b, avgdl) for the sparse vectors; the first write fixes
        ``avgdl`` to its chunks' mean length in tokens (at least 1)."""
        if self.manifest.bm25.avgdl is None:
            avgdl = max(1.0, sum(len(t) for t in tokens) / max(1, len(tokens)))
            self._journal.amend(self.manifest.with_bm25_avgdl(avgdl))
        return self.manifest.bm25.model_dump()

    def _write_leaves_from_cache(self, leaves: Sequence[BaseNode], show_progress: bool = False, desc: str = "Writing points") -> None:
        """(Re)write the points of committed ``leaves``, their vectors from the embedding cache (the
        model embeds what it lacks): a roll-back, a migration and a purge. ``show_progress``: a bar
        over the texts embedded (if any), then one named ``desc`` over the points written."""
        if not leaves:
            return
        texts = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in leaves]
        vectors = embed_texts(self.embed_model, texts, self.cache, batch_size=self.manifest.embed_batch_size, show_progress=show_progress)
        self._ensure_collection(vectors.shape[1])
        bar = _progress_bar(show_progress, desc, total=len(leaves), unit="point")
        try:
            self._write_points(leaves, vectors, progress=None if bar is None else bar.update)
        finally:
            if bar is not None:
                bar.close()

    def _begin(self, touched_ids: Sequence[str]) -> None:
        """Record what the next write touches (:meth:`.journal.WriteJournal.begin`), so a crash can
        be rolled back on open; remember the committed BM25 state for :meth:`_recover`."""
        self._write_start_snapshot = self.bm25.snapshot
        self._journal.begin(touched_ids)

    def _recover(self) -> None:
        """After a failed write: read the committed generation again and roll the store back to it.

        A write changes BM25 and the docstore in memory before it commits, so without this the
        live object would keep serving the half-done write. When recovery fails too, the journal
        stays in index.json (:meth:`load` rolls back on the next open) and this object turns
        read-only on the committed state: BM25 answers from the state the write started from,
        dense search from the embedding cache, and store-side search and writes raise
        :class:`~.storage.IndexReadOnlyError` (its point store is closed) until reopened.
        """
        try:
            self._sync_with_disk(reload=True)
        except Exception as exc:
            logger.exception("%s: could not roll back the failed write in this process; HybridIndex.load will", self.storage_dir)
            if self._write_start_snapshot is not None:
                self.bm25.restore_snapshot(self._write_start_snapshot)
            self._enter_read_only(f"the roll-back of a failed write could not be done ({type(exc).__name__}: {exc})")
        self._write_start_snapshot = None

    def _sync_with_disk(self, reload: bool = False, state_is_committed: bool = False, show_progress: bool = False) -> None:
        """Catch up with the committed state on disk (under the write guard).

        Reads the committed generation when another process committed one since (or when
        ``reload``), and then rolls back a journal left in index.json. A journal this object left
        itself (its own failed write, its in-memory state possibly uncommitted) is only rolled back
        when ``state_is_committed`` (just opened); otherwise the next write extends it. Runs before
        every write, after a failed one, and on open. A folder rebuilt since this object opened it
        (another ``build_id`` on disk) turns this object read-only and raises (:meth:`_rebuilt_elsewhere`):
        nothing is written over the new index. ``show_progress``: the roll-back's bars (on open only).
        """
        disk = self._journal.read_disk()
        if disk.build_id != self.manifest.build_id:
            raise self._rebuilt_elsewhere(disk)
        fresh = state_is_committed
        if reload or disk.generation != self.manifest.generation:
            fresh = True
            gen = disk.generation
            _storage.verify_generation(self.storage_dir, gen, disk.integrity_record, self._journal.path)
            committed, docstore = read_generation(self.storage_dir, gen, self.tokenizer_config.custom_tokenizer)
            self._serve_generation(disk, committed, docstore)
        else:
            self._adopt_disk_manifest(disk)
        pending = self.manifest.pending
        if fresh and pending is not None:
            self._roll_back(pending, show_progress)

    def _adopt_disk_manifest(self, disk: IndexManifest) -> None:
        """Take ``disk`` (``index.json`` now, same generation as this object's) as the manifest: the
        folder's record wins over memory in every field, not only ``pending``, so a commit never
        writes a state the folder did not record (e.g. a server switch whose write failed). The
        server URL this object was opened with (``load(qdrant_url=...)``: where the server moved
        to) is kept. When ``disk`` names another point store than the one this object writes to
        (the shard vs a server collection), nothing can be reconciled here: this object turns
        read-only and raises :class:`~.storage.IndexReadOnlyError` saying to reopen the folder."""
        mine = self.manifest
        disk_store = f"Qdrant collection {disk.collection!r} at {disk.qdrant_url}" if disk.qdrant_url else f"the shard in {self.storage_dir / STORE_DIR}"
        if (disk.qdrant_url is None) != (self.store.kind == "edge") or (disk.qdrant_url is not None and disk.collection != mine.collection):
            reason = f"index.json names {disk_store} as the folder's point store, but this object writes to {self.store.location}"
            advice = "Open the folder again with HybridIndex.load (it serves what index.json names)"
            if self._read_only is None:
                self._enter_read_only(reason, advice)
            raise _storage.IndexReadOnlyError(self.storage_dir, reason, advice)
        adopted = disk.with_qdrant_url(mine.qdrant_url) if disk.qdrant_url and mine.qdrant_url else disk
        if adopted.embed_dim is None and mine.embed_dim is not None:  # the collection exists (created before a write failed)
            adopted = adopted.with_embed_dim(mine.embed_dim)
        if adopted.with_pending(None) != mine.with_pending(None):
            logger.warning("%s: this object's manifest differed from index.json (a failed write?); index.json's is used", self.storage_dir)
        self._journal.amend(adopted)

    def _rebuilt_elsewhere(self, disk: IndexManifest) -> _storage.IndexReadOnlyError:
        """Turn read-only (once) because ``disk``, the folder's manifest now, is another build's:
        the folder was rebuilt while this object had it open, and writing would damage the new
        index. Returns the error to raise."""
        reason = (
            f"the folder was rebuilt since this object opened it (it now holds build {disk.build_id}, this object "
            f"opened build {self.manifest.build_id})"
        )
        if self._read_only is None:
            self._enter_read_only(reason, REBUILT_ADVICE)
        return _storage.IndexReadOnlyError(self.storage_dir, reason, REBUILT_ADVICE)

    def _enter_read_only(self, reason: str, what_to_do: Optional[str] = None) -> None:
        """Serve the committed state only (see :meth:`_recover`); the store may hold uncommitted points.
        ``what_to_do``: the advice of the errors raised from now on (None: free disk space and reopen)."""
        self._read_only = reason
        self._read_only_advice = what_to_do
        error = _storage.IndexReadOnlyError(self.storage_dir, reason, what_to_do)
        self._rw_lock = _storage.RefusingLock(error)  # store-side retrievers made from now on raise it
        self._dense = None
        try:
            self.store.close()  # those made earlier fail too, and the folder's store lock is free
        except Exception:  # pragma: no cover - closing is best effort here
            logger.debug("closing the point store of a read-only index failed", exc_info=True)
        logger.warning("%s", error)

    def _check_writable(self) -> None:
        if self._served_elsewhere is not None:
            advice = READ_ONLY_ADVICE if self._opened_read_only else SERVED_ELSEWHERE_ADVICE
            raise _storage.IndexReadOnlyError(self.storage_dir, self._served_elsewhere, advice)
        if self._read_only is not None:
            raise _storage.IndexReadOnlyError(self.storage_dir, self._read_only, READ_ONLY_ADVICE if self._opened_read_only else self._read_only_advice)

    def _finish_open(self, verified: bool, show_progress: bool = False) -> None:
        """On :meth:`load`, under the write lock (so that no write of another process sharing a
        Qdrant server is half done): roll back an unfinished write (``show_progress``: its bars),
        read-only when that cannot be written, then compare the Qdrant point count with the BM25 index."""
        with contextlib.ExitStack() as locked:
            try:
                locked.enter_context(self._write_guard.hold(timeout=0))
            except _storage.IndexWriteLockedError:
                # Another process (sharing a Qdrant server) is writing: a journal is its own, not a crash.
                logger.info("%s: a write is running in another process; opening the committed index", self.storage_dir)
                return
            except OSError as exc:  # no lock file in a read-only folder: then no one writes there either
                if self.manifest.pending is not None:
                    self._enter_read_only(f"an unfinished write cannot be rolled back ({type(exc).__name__}: {exc})")
            if self.manifest.pending is not None and self._read_only is None:
                try:
                    self._sync_with_disk(state_is_committed=True, show_progress=show_progress)
                except (OSError, sqlite3.Error) as exc:
                    self._enter_read_only(
                        f"an unfinished write could not be rolled back ({type(exc).__name__}: {exc}); the committed "
                        "index is served, Qdrant still holds the unfinished write's points"
                    )
            if self._read_only is None:
                self._check_point_count()
        if not verified:
            logger.info(
                "%s was written before index.json recorded checksums: its files are unverified until the next write",
                self.storage_dir,
            )

    def _server_copy_state(self) -> Optional[FolderState]:
        """The folder state the server copy this object serves records (None: none recorded)."""
        return FolderState.from_json(self.store.copied_state())

    def _check_server_copy(self) -> None:
        """On :meth:`load` of an embedded folder with ``qdrant_url``: the server collection must be a
        copy of the folder's committed state (the state ``push_to`` recorded in its metadata) holding
        one point per chunk; otherwise :class:`StaleServerCopyError` (push again). A missing
        collection is refused too, unless the folder holds no chunk (then nothing can be served)."""
        url = str(self.manifest.qdrant_url)
        location = self.store.location
        if not self.store.exists():
            if len(self.bm25):
                raise StaleServerCopyError(self.storage_dir, location, url, f"does not exist (nothing was pushed there as {self.manifest.collection!r})")
            return
        folder = self.manifest.folder_state
        copy = self._server_copy_state()
        if copy is None:
            raise StaleServerCopyError(
                self.storage_dir,
                location,
                url,
                "records no state of the folder it copies (pushed by a version before push_to recorded it, or kept "
                "by a Qdrant server before 1.16, which drops collection metadata: push to 1.16 or later)",
            )
        if copy != folder:
            raise StaleServerCopyError(
                self.storage_dir, location, url, f"is a copy of the folder at {copy.describe()}, but the folder has committed {folder.describe()}"
            )
        points, chunks = self.store.count(), len(self.bm25)
        if points != chunks:
            raise StaleServerCopyError(
                self.storage_dir, location, url, f"holds {points} point(s) but the folder {chunks} chunk(s) (changed on the server since it was pushed)"
            )

    def _copy_holds(self, copy: Optional[FolderState], manifest: IndexManifest) -> bool:
        """Whether the server copy (its recorded state ``copy``) holds ``manifest``'s committed
        state; if not, a warning once per generation (:meth:`refresh` keeps the one it serves)."""
        if copy is not None and copy == manifest.folder_state:
            return True
        if self._stale_copy_warned != manifest.generation:
            self._stale_copy_warned = manifest.generation
            held = copy.describe() if copy is not None else "no recorded state"
            logger.warning(
                "%s: the folder committed generation %d, but %s holds %s; still serving generation %d. %s",
                self.storage_dir,
                manifest.generation,
                self.store.location,
                held,
                self.manifest.generation,
                push_again_advice(self.storage_dir, str(self.manifest.qdrant_url)),
            )
        return False

    def _check_point_count(self) -> None:
        points = self.store.count()
        chunks = len(self.bm25)
        where = self.store.location
        if points != chunks:
            raise _storage.DamagedIndexError(
                where, f"holds {points} point(s) but the BM25 index holds {chunks} chunk(s)", self.storage_dir
            )
        record = self.manifest.integrity
        if record is not None and record.chunks != chunks:
            raise _storage.DamagedIndexError(
                _storage.bm25_dir(self.storage_dir, self.manifest.generation),
                f"holds {chunks} chunk(s) but index.json recorded {record.chunks}",
                self.storage_dir,
            )

    def _commit(self, reload_store: bool = True) -> None:
        """Points on disk first (and live statistics), then the next generation's BM25 and
        docstore, then index.json switched to it (:meth:`.journal.WriteJournal.commit`).

        ``reload_store=False`` when the write only added new points: the shard is flushed but not
        reloaded (``store.refresh`` reloads it for exact IDF statistics after deletes and
        replacements; with inserts only, the live statistics are already exact)."""
        if reload_store:
            self.store.refresh()
        else:
            self.store.flush()
        self._journal.commit(self.bm25, self.docstore)
        self._dense = None
        self._write_start_snapshot = None

    def _roll_back(self, pending: PendingWrite, show_progress: bool = False) -> None:
        """Make the point store agree with the committed docstore for the ids an unfinished write
        touched (kept chunks rewritten from the embedding cache, the others deleted), then clear
        the journal (:meth:`.journal.WriteJournal.finish_roll_back`). ``show_progress``: a bar
        (:data:`ROLL_BACK_STEP`) over the points rewritten."""
        logger.warning(
            "%s: the last update did not finish; restoring %d chunk(s) of the committed index", self.storage_dir, len(pending.touched_ids)
        )
        keep, drop = split_touched(pending.touched_ids, self.docstore.docs)
        if drop:
            self.store.delete_points([_store.point_id(i) for i in drop])
        self._write_leaves_from_cache([n for n in keep if not n.child_nodes], show_progress, ROLL_BACK_STEP)
        self.store.refresh()
        self._dense = None
        self._journal.finish_roll_back(pending)

    # ------------------------------------------------------------------ reads
    @property
    def vector_store(self) -> Any:
        """The server collection as a LlamaIndex ``QdrantVectorStore`` (dense vectors); an index on
        a Qdrant server only (``QdrantVectorStore`` needs a qdrant-client)."""
        if self.store.kind != "server":
            raise ValueError(
                f"{self.storage_dir} is embedded (Qdrant Edge): QdrantVectorStore needs a Qdrant server; build or "
                "open the index with qdrant_url=..., or use as_retriever(mode='dense')"
            )
        if self._vector_store is None:
            from llama_index.vector_stores.qdrant import QdrantVectorStore

            self._vector_store = QdrantVectorStore(collection_name=self.manifest.collection, client=self.store.client)
        return self._vector_store

    @property
    def client(self) -> Any:
        """The ``QdrantClient`` of an index on a Qdrant server (an embedded index has none)."""
        if self.store.kind != "server":
            raise AttributeError(f"{self.storage_dir} is embedded (Qdrant Edge) and has no QdrantClient; see HybridIndex.store")
        return self.store.client

    def __len__(self) -> int:
        return len(self.bm25)

    def as_retriever(
        self,
        mode: str = "hybrid",
        similarity_top_k: int = 10,
        filters: Optional[MetadataFilters] = None,
        callback_manager: Optional[CallbackManager] = None,
        verbose: bool = False,
        **options: Any,
    ) -> BaseRetriever:
        """A retriever over this index.

        Modes:

        * ``"hybrid"`` (recommended): BM25 + dense, fused in process by the rule chosen on the
          BEIR train/dev splits (benchmarks/default_fusion.py, docs/benchmarks.md): the union of
          both legs' top ``candidate_top_k`` (default 200) scored exactly by both, plus a feedback
          leg (cosine to the first pass's best chunk), z-scored and weighted ``[bm25, dense,
          feedback]`` = 0.3 / 0.3 / 0.4 (:class:`~llama_index_retrieval_kit.retrievers.fusion.IndexFusion`);
          results carry ``"bm25"``, ``"dense"`` and ``"feedback"`` leg ranks and scores. It needs
          the vectors in memory: with ``dense_search="qdrant"`` (or a server under ``"auto"``)
          ``"hybrid"`` is ``"hybrid_score"``;
        * ``"hybrid_score"``: convex combination of min-max normalised leg scores (``weights``), the
          default of ``"hybrid"`` before the feedback fusion;
        * ``"hybrid_rrf"``: reciprocal rank fusion, ``sum w / (rrf_k + rank)``;
        * ``"dense"``, ``"sparse"`` (BM25): one leg;
        * ``"qdrant_hybrid"``: RRF inside Qdrant (the path for a Qdrant server or cluster).

        Every mode takes ``similarity_top_k``, ``filters``, ``callback_manager`` and ``verbose``.
        ``filters`` mean the same in every mode: they are evaluated on each chunk's metadata
        (``metadata["doc_id"]``, not Qdrant's payload copy of ``Document.id_``) by
        :func:`~llama_index_retrieval_kit.retrievers.filters.metadata_matches`, and Qdrant is
        asked for exactly the matching chunks. Further options, per mode (:data:`RETRIEVER_OPTIONS`):
        ``candidate_top_k`` (each leg's depth, default 100; 200 for ``"hybrid"``'s feedback
        fusion), ``weights`` (per leg, ``[bm25, dense]``; for ``"hybrid"``'s feedback fusion
        ``[bm25, dense, feedback]``, or ``[bm25, dense]`` with the feedback leg kept at 0.4),
        ``rrf_k`` (default 60), ``fusion`` (``qdrant_hybrid``: ``"rrf"``, the default, or
        ``"dbsf"``), ``leg_scores`` (``qdrant_hybrid``: True, the default, also runs each leg
        on its own in the engine's batch so results carry their leg ranks and scores for the
        no-answer gate and the trace; False, about half the engine time, fused scores only), ``dense_search``: ``"memory"`` (exact cosine over the
        stored vectors in numpy; fused modes then fuse in arrays), ``"qdrant"`` (Qdrant's own
        search) or ``"auto"`` (memory in local mode, Qdrant for a server). An option a mode does
        not use is refused (``ValueError``), an unknown one too (``TypeError``); ``None`` means
        "not given".
        """
        mode = check_retriever_mode(mode)
        check_positive_int("similarity_top_k", similarity_top_k)
        filters = validate_filters(filters)
        given = check_retriever_options(mode, options)
        common = {"callback_manager": callback_manager, "verbose": verbose}
        dense_search = given.get("dense_search", "auto")
        dense_search = DenseSearch.from_str(dense_search).value
        feedback = mode == "hybrid" and self._dense_in_memory(dense_search)
        default_depth = DEFAULT_FEEDBACK_DEPTH if feedback else 100
        candidate_top_k = check_positive_int("candidate_top_k", given.get("candidate_top_k", default_depth))
        rrf_k = given.get("rrf_k", DEFAULT_RRF_K)
        weights = given.get("weights")
        if mode == "sparse":
            return self._bm25_view(filters, similarity_top_k, **common)
        if mode == "dense":
            return self._dense_retriever(filters, similarity_top_k, dense_search, **common)
        depth = max(candidate_top_k, similarity_top_k)
        if mode == "qdrant_hybrid":
            if weights is not None and len({float(w) for w in weights}) > 1:
                raise ValueError(
                    f"mode='qdrant_hybrid' cannot weight its legs ({list(weights)!r}): Qdrant's weighted RRF is not "
                    "w / (k + rank); use mode='hybrid_rrf' for weighted fusion"
                )
            self._hint_unindexed()
            return QdrantHybridRetriever(
                self.store,
                self.config["collection"],
                self.embed_model,
                self.bm25.tokenize,
                similarity_top_k=similarity_top_k,
                candidate_top_k=depth,
                rrf_k=rrf_k,  # QdrantHybridRetriever rejects a non-integer k instead of truncating it
                fusion=self._engine_fusion(given),
                leg_scores=given.get("leg_scores", True),
                filters=filters,
                point_filter=self._point_filter(),
                read_guard=self._rw_lock.read,
                node_lookup=self._node_lookup(),
                **common,
            )
        fusion = IndexFusion.FEEDBACK if feedback else IndexFusion.RRF if mode == "hybrid_rrf" else IndexFusion.SCORE
        if self._dense_in_memory(dense_search):
            return FusedIndexRetriever(
                self._bm25_view(filters, depth),
                self.dense_matrix,
                self.embed_model,
                mode=fusion.value,
                rrf_k=rrf_k,
                weights=weights,
                candidate_top_k=depth,
                similarity_top_k=similarity_top_k,
                **common,
            )
        # Both legs under one hold of the read lock (a write between them would mix two states);
        # the dense leg then takes no lock of its own: the lock favours waiting writers, so a
        # nested read could deadlock.
        legs = [self._bm25_view(filters, depth), self._dense_retriever(filters, depth, dense_search, guarded=False)]
        return HybridRetriever(
            legs,
            names=["bm25", "dense"],
            mode=fusion.value,
            rrf_k=rrf_k,
            weights=weights,
            similarity_top_k=similarity_top_k,
            read_guard=self._rw_lock.read,
            **common,
        )

    @staticmethod
    def _engine_fusion(given: Dict[str, Any]) -> str:
        fusion = EngineFusion.from_str(given.get("fusion", "rrf")).value
        if fusion == "dbsf" and "rrf_k" in given:
            raise ValueError(f"rrf_k ({given['rrf_k']!r}) has no part in fusion='dbsf'; leave it out or use fusion='rrf'")
        return fusion

    def _dense_in_memory(self, dense_search: str) -> bool:
        return dense_search == "memory" or (dense_search == "auto" and not self.manifest.qdrant_url)

    def _bm25_view(self, filters: Optional[MetadataFilters], top_k: int, **common: Any) -> BM25Retriever:
        return self.bm25.with_filters(filters, similarity_top_k=top_k, **common)

    def _dense_retriever(
        self, filters: Optional[MetadataFilters], top_k: int, dense_search: str = "auto", guarded: bool = True, **common: Any
    ) -> BaseRetriever:
        """The dense leg; ``guarded=False`` for a Qdrant-side leg run under a read lock its caller holds."""
        if self._dense_in_memory(dense_search):
            return ExactDenseRetriever(self.dense_matrix, self.embed_model, similarity_top_k=top_k, filters=filters, **common)
        self._hint_unindexed()
        return QdrantDenseRetriever(
            self.store,
            self.config["collection"],
            self.embed_model,
            similarity_top_k=top_k,
            filters=filters,
            point_filter=self._point_filter(),
            read_guard=self._rw_lock.read if guarded else None,
            node_lookup=self._node_lookup(),
            **common,
        )

    def _node_lookup(self) -> Optional[Callable[[Sequence[str]], List[Optional[BaseNode]]]]:
        """For engine-side search on the embedded store: the result nodes as copies of the index's
        own (looked up by point id in the BM25 snapshot, whose leaves are exactly the shard's
        points, written together under the write lock) instead of parsed from each payload's
        JSON (~20 us per result). Also for an embedded folder served from its server copy
        (``load(dir, qdrant_url=)``, checked to be a copy of the committed state): results are the
        folder's committed chunks; a point the folder lacks (a newer push not yet followed by
        :meth:`refresh`) makes the retriever warn and read that query's payloads. None for an
        index living on a server, whose points another writer may have changed: its results are
        read from their payloads."""
        if not isinstance(self.store, _store.EdgePoints) and not self._serves_copy:
            return None

        def lookup(point_ids: Sequence[str]) -> List[Optional[BaseNode]]:
            snapshot = self.bm25.snapshot
            cached = self._nodes_by_point
            if cached is None or cached[0] is not snapshot:
                cached = (snapshot, {_store.point_id(node.node_id): node for node in snapshot.nodes})
                self._nodes_by_point = cached
            by_point = cached[1]
            return [None if node is None else copy_node(node) for node in map(by_point.get, point_ids)]

        return lookup

    def _hint_unindexed(self) -> None:
        """Say once per index object when engine-side dense search will scan many vectors without
        HNSW (:data:`PLAIN_SCAN_HINT_VECTORS`), and how to index them."""
        if self._unindexed_hinted or self.manifest.qdrant_url or self._read_only is not None:
            return
        self._unindexed_hinted = True
        try:
            unindexed = self.store.unindexed_vectors()
        except Exception:  # a hint never fails a retriever
            logger.debug("could not read the store's index status", exc_info=True)
            return
        if unindexed >= PLAIN_SCAN_HINT_VECTORS:
            logger.warning(
                "%s: %d vector(s) have no HNSW index, so engine-side dense search scans them all "
                "(exact, slower as the index grows); build it once with index.optimize() or "
                "`rkit index --hnsw` (about 0.6 ms per vector)",
                self.storage_dir,
                unindexed,
            )

    def _point_filter(self) -> Callable[[MetadataFilters], Any]:
        """For Qdrant-side search: a callable giving, for a retriever's current filters, the
        Qdrant filter that admits exactly the chunks they match (``metadata_matches``, as every
        in-memory leg): the store's translation run by the engine where it is exact, else the
        matching ids (``store.metadata_filter``). Cached per index state and filter *value*
        (``filters_key``, as the in-memory legs' masks): filters the caller changes in place, or
        replaces (``retriever.filters = ...``), after building the retriever are followed, never
        answered from their old value."""
        from ..retrievers.filters import filters_key

        cache: List[Any] = [None]  # (snapshot, filters_key, Qdrant filter), replaced whole

        def point_filter(filters: MetadataFilters) -> Any:
            snapshot = self.bm25.snapshot
            value = filters_key(filters)
            cached = cache[0]
            if cached is None or cached[0] is not snapshot or cached[1] != value:
                cached = cache[0] = (snapshot, value, self.store.metadata_filter(filters, snapshot.nodes))
            return cached[2]

        return point_filter

    def dense_matrix(self, snapshot: Any = None) -> DenseMatrix:
        """The indexed dense vectors as a matrix whose rows follow the BM25 index's node order.

        Read from Qdrant once per index generation. Local mode answers dense queries from it: the
        same exact cosine search Qdrant local mode runs, without its per-point Python work, and
        with positions shared with BM25 so that fusion runs on arrays. It holds a second copy of
        the vectors in memory (4 bytes x dimension per chunk: 1.5 GB per million MiniLM chunks).

        Consistency with concurrent writes: the store is read under the index's read lock, where
        no write runs and ``self.bm25.snapshot`` is the state the store holds. A ``snapshot`` a
        write has replaced since the caller took it (e.g. a fused query's BM25 leg) is answered
        from the embedding cache, keyed by each chunk's text, never with the newer vectors.
        """
        given = snapshot
        cached = self._dense
        if cached is not None and cached[0] is (given if given is not None else self.bm25.snapshot):
            return cached[1]
        if self._read_only is not None:  # Qdrant may hold an unfinished write: not read
            with self._dense_lock:
                snapshot = given if given is not None else self.bm25.snapshot
                cached = self._dense
                if cached is not None and cached[0] is snapshot:
                    return cached[1]
                with _storage.paused_gc():
                    self._dense = (snapshot, self._cached_dense_matrix(snapshot))
                return self._dense[1]
        with self._rw_lock.read(), self._dense_lock:  # always in this order (read side first)
            current = self.bm25.snapshot
            snapshot = given if given is not None else current
            cached = self._dense
            if cached is not None and cached[0] is snapshot:
                return cached[1]
            with _storage.paused_gc():  # bulk allocation over a large heap: see storage.paused_gc
                if snapshot is not current:  # replaced by a write since the caller took it
                    return self._cached_dense_matrix(snapshot)
                matrix, complete = self._read_dense_matrix(snapshot)
            if complete:
                self._dense = (snapshot, matrix)
            return matrix

    def _cached_dense_matrix(self, snapshot: Any) -> DenseMatrix:
        """The committed chunks' vectors from the embedding cache (the model embeds what it lacks,
        without writing the cache): a read-only index's dense leg, which must not read Qdrant."""
        nodes = snapshot.nodes
        dim = self.manifest.embed_dim or 1
        if not nodes:
            return DenseMatrix.build(nodes, np.zeros((0, dim), dtype=np.float32), copy_nodes=False)
        texts = [n.get_content(metadata_mode=MetadataMode.EMBED) for n in nodes]
        keys = [text_key(t) for t in texts]
        found = self.cache.get_many(model_key(self.embed_model), keys)
        missing = sorted({k: t for k, t in zip(keys, texts) if k not in found}.items())
        if missing:
            logger.warning("%s: %d chunk(s) of the committed index are not in the embedding cache; embedding them", self.storage_dir, len(missing))
            vectors = embed_texts(self.embed_model, [t for _, t in missing], cache=None)
            found.update({k: v for (k, _), v in zip(missing, vectors)})
        return DenseMatrix.build(nodes, np.stack([found[k] for k in keys]), copy_nodes=False)

    def _read_dense_matrix(self, snapshot: Any) -> tuple[DenseMatrix, bool]:
        """The store's vectors in ``snapshot``'s node order, and whether they matched it exactly.
        Called under the read lock (:meth:`dense_matrix`), with the current snapshot."""
        dim = self.manifest.embed_dim or 1
        nodes = snapshot.nodes
        if not nodes:
            return DenseMatrix.build(nodes, np.zeros((0, dim), dtype=np.float32), copy_nodes=False), True
        if not self.store.exists():  # under the read lock: no write is reloading the store
            raise _storage.DamagedIndexError(
                self.store.location, f"is missing, but the index holds {len(nodes)} chunk(s)", self.storage_dir
            )
        stored_ids, stored = self.store.dense_block()
        if len(stored_ids) and stored.shape[1] != dim:
            raise _storage.DamagedIndexError(
                self.store.location, f"holds {stored.shape[1]}-dimensional vectors, the index {dim}-dimensional ones", self.storage_dir
            )
        position = {pid: i for i, pid in enumerate(stored_ids)}
        rows = np.fromiter((position.get(_store.point_id(n.node_id), -1) for n in nodes), dtype=np.int64, count=len(nodes))
        found = rows >= 0
        missing = np.flatnonzero(~found)
        extra = len(stored_ids) - int(found.sum())
        vectors = np.zeros((len(nodes), dim), dtype=np.float32)
        vectors[found] = stored[rows[found]]
        complete = not missing.size and not extra
        if not complete:
            # Seen only while a write is between its Qdrant and BM25 steps, or in a folder changed
            # outside HybridIndex: answer with what is there and read again on the next query.
            logger.warning(
                "%s: Qdrant and BM25 disagree (%d chunk(s) without a vector, %d vector(s) without a chunk); "
                "if no update is running, rebuild the folder with from_documents(..., overwrite=True)",
                self.storage_dir,
                missing.size,
                extra,
            )
        if complete and not self._vectors_checked and snapshot is self.bm25.snapshot:
            self._check_vectors(nodes, vectors)  # once per opened index: damage happens at rest
        logger.debug("dense matrix: %d vectors read from Qdrant", len(stored_ids))
        return DenseMatrix.build(nodes, vectors, copy_nodes=False), complete

    def _check_vectors(self, nodes: Sequence[BaseNode], vectors: np.ndarray) -> None:
        """Each stored vector must be its chunk's embedding (as cached when it was indexed): a
        folder whose Qdrant points were swapped or overwritten is a DamagedIndexError, not wrong
        answers. Chunks whose embedding is no longer cached are not checked."""
        keys = [text_key(n.get_content(metadata_mode=MetadataMode.EMBED)) for n in nodes]
        cached = self.cache.get_many(model_key(self.embed_model), keys)
        self._vectors_checked = True
        rows = np.asarray([i for i, key in enumerate(keys) if key in cached], dtype=np.int64)
        if not rows.size:
            return
        stored = vectors if rows.size == len(keys) else vectors[rows]
        found = [cached[keys[i]] for i in rows.tolist()]
        bad = np.asarray([j for j, vec in enumerate(found) if vec.shape != (stored.shape[1],)], dtype=np.int64)
        if not bad.size:  # cosine(stored, expected) row by row, without normalised copies of either matrix
            expected = np.stack(found).astype(np.float32, copy=False)
            dots = np.einsum("ij,ij->i", stored, expected).astype(np.float64)
            norms = np.sqrt(np.einsum("ij,ij->i", stored, stored).astype(np.float64) * np.einsum("ij,ij->i", expected, expected))
            bad = np.flatnonzero(~(dots >= 0.99 * np.maximum(norms, 1e-24)))  # NaN (garbage bytes) is bad too
        if bad.size:
            self._vectors_checked = False
            node = nodes[int(rows[int(bad[0])])]
            where = self.store.location
            raise _storage.DamagedIndexError(
                where,
                f"{bad.size} point(s) hold a vector that is not their chunk's embedding (e.g. chunk {node.node_id} of "
                f"{node.ref_doc_id!r}): the points were changed outside HybridIndex",
                self.storage_dir,
            )

    def as_query_engine(self, llm: Any = None, mode: str = "hybrid", similarity_top_k: int = 5, **kwargs: Any) -> Any:
        """A ``RetrieverQueryEngine`` over :meth:`as_retriever`; ``llm`` defaults to ``Settings.llm``.

        As with ``VectorStoreIndex.as_query_engine``, retriever options (``filters``,
        ``candidate_top_k``, ...; see :meth:`as_retriever`) go to the retriever and the
        rest to ``RetrieverQueryEngine.from_args`` (``node_postprocessors``, ``response_mode``,
        ``text_qa_template``, ``streaming``, ...); ``callback_manager`` and ``verbose`` go to both.
        A keyword neither takes is refused (``TypeError``), never dropped.
        """
        from llama_index.core.query_engine import RetrieverQueryEngine

        retriever_kwargs, engine_kwargs = split_query_engine_kwargs(mode, kwargs)
        if llm is None and settings_llm() is None:
            raise ValueError(
                "as_query_engine needs an LLM: pass llm=... (any LlamaIndex LLM) or set "
                "llama_index.core.Settings.llm; this package never falls back to a paid API"
            )
        retriever = self.as_retriever(mode=mode, similarity_top_k=similarity_top_k, **retriever_kwargs)
        return RetrieverQueryEngine.from_args(retriever, llm=llm, **engine_kwargs_for(llm, engine_kwargs))

    def as_chat_engine(
        self, chat_mode: Any = "condense_plus_context", llm: Any = None, mode: str = "hybrid", similarity_top_k: int = 5, **kwargs: Any
    ) -> Any:
        """One of LlamaIndex's chat engines over this index, as ``BaseIndex.as_chat_engine`` builds them:
        ``chat_mode`` ``"condense_plus_context"`` (default; LlamaIndex's ``"best"`` is the same) or
        ``"context"`` over :meth:`as_retriever` (``mode``, ``similarity_top_k``), or
        ``"condense_question"`` over :meth:`as_query_engine`; LlamaIndex's ``ChatMode`` members work
        too. ``llm`` defaults to ``Settings.llm``. Retriever options go to the retriever (and, for
        ``condense_question``, ``RetrieverQueryEngine.from_args`` options to the query engine), the
        chat engine's ``from_defaults`` options (``node_postprocessors``, ``system_prompt``,
        ``memory``, ...) to it; a keyword none takes is refused (``TypeError``), never dropped.
        Modes that never read the index (``simple``, ``react``, ``openai``) are refused saying what to
        build instead (see :mod:`.chat_engines`)."""
        from .chat_engines import build_chat_engine

        return build_chat_engine(self, chat_mode, llm, mode, similarity_top_k, kwargs)
