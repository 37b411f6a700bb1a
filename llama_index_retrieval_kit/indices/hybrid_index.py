"""``HybridIndex``: one storage folder holding a Qdrant collection, a BM25 index and a docstore.

Layout of ``storage_dir``::

    index.json            config + manifest (embedding model, parser, BM25 settings, generation)
    qdrant/               Qdrant local-mode data (absent when ``qdrant_url`` points at a server)
    bm25/gen-<N>/         the BM25 index of generation N
    docstore/gen-<N>.json every node (parents too), for AutoMergingRetriever and re-indexing
    embeddings.sqlite     embedding cache keyed by (model, text hash)

Writes are crash-safe: an update first records the node ids it will touch in ``index.json``
(``pending``), then writes Qdrant and the next generation's files, then switches
``index.json`` to the new generation in one atomic rename. Opening a folder whose last update
did not finish rolls Qdrant back to the committed generation (vectors come from the embedding
cache), so the previous index is what you read. A write that fails with an exception does the
same roll-back at once in the live object; if that fails too, the journal keeps every touched
id (it only grows until a commit) and the next open repairs the folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence

import numpy as np
from llama_index.core.base.base_retriever import BaseRetriever
from llama_index.core.base.embeddings.base import BaseEmbedding
from llama_index.core.callbacks.base import CallbackManager
from llama_index.core.node_parser import NodeParser, get_leaf_nodes
from llama_index.core.schema import BaseNode, Document, MetadataMode
from llama_index.core.storage.docstore import SimpleDocumentStore
from llama_index.core.vector_stores.types import MetadataFilters
from llama_index.core.vector_stores.utils import node_to_metadata_dict
from qdrant_client import QdrantClient, models

from ..models import DEFAULT_EMBED_MODEL, default_embed_model, embed_model_name
from ..node_parser import SectionHierarchyNodeParser, SectionWindowNodeParser
from ..retrievers.bm25 import BM25Retriever, BM25TokenizerConfig
from ..retrievers.checks import check_positive_int
from ..retrievers.exact_dense import DenseMatrix, ExactDenseRetriever
from ..retrievers.filters import metadata_matches, validate_filters
from ..retrievers.fusion import DEFAULT_RRF_K
from ..retrievers.hybrid import HybridRetriever
from ..retrievers.qdrant_hybrid import (
    DENSE_VECTOR,
    SPARSE_VECTOR,
    QdrantDenseRetriever,
    QdrantHybridRetriever,
    bm25_doc_vector,
    point_ids_filter,
    sparse_vectors_config,
)
from .embedding_cache import EmbeddingCache, embed_texts
from .fused_retriever import FusedIndexRetriever
from .rwlock import ReadWriteLock

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
COLLECTION = "chunks"
RetrieverMode = Literal["hybrid", "hybrid_score", "hybrid_rrf", "dense", "sparse", "qdrant_hybrid"]
RETRIEVER_MODES: tuple[str, ...] = ("hybrid", "hybrid_score", "hybrid_rrf", "dense", "sparse", "qdrant_hybrid")
DENSE_SEARCH: tuple[str, ...] = ("auto", "memory", "qdrant")
SCROLL_PAGE = 2048


def _describe_model(class_name: Optional[str], name: str) -> str:
    """``'name' (ClassName)`` for error messages (a model name alone can be as vague as 'unknown')."""
    return f"{name!r} ({class_name})" if class_name else repr(name)


def _parser_from_dict(data: Dict[str, Any]) -> NodeParser:
    """Rebuild the node parser recorded in index.json (ours or LlamaIndex's core parsers)."""
    from llama_index.core import node_parser as core_parsers

    name = data.get("class_name")
    ours = {"SectionWindowNodeParser": SectionWindowNodeParser, "SectionHierarchyNodeParser": SectionHierarchyNodeParser}
    if name in ours:
        return ours[name].from_dict(data)
    for attr in dir(core_parsers):
        cls = getattr(core_parsers, attr)
        if isinstance(cls, type) and issubclass(cls, NodeParser) and getattr(cls, "class_name", None):
            try:
                if cls.class_name() == name:
                    clean = {k: v for k, v in data.items() if k != "id_func"}
                    return cls.from_dict(clean)
            except TypeError:
                continue
    raise ValueError(f"index.json names node parser {name!r}, which this version cannot rebuild; pass node_parser=")


def _write_json_atomic(path: Path, data: Dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class IndexBusyError(RuntimeError):
    """The index folder is open elsewhere (embedded Qdrant allows one open index per folder)."""

    def __init__(self, storage_dir: Path) -> None:
        self.storage_dir = Path(storage_dir)
        super().__init__(
            f"index {storage_dir} is open in another process (or another HybridIndex in this one) and the "
            "embedded store allows one at a time: close the other one (index.close(), or end that process), "
            "or serve the index from a Qdrant server and open it with qdrant_url=..."
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


def document_origin(metadata: Dict[str, Any]) -> Optional[str]:
    """The absolute path of the file a document or chunk was read from, or None when unknown.

    ``metadata["file_path"]`` (written by this package's readers, and by LlamaIndex's
    ``SimpleDirectoryReader``); for chunks indexed before it existed, ``source`` resolved.
    """
    path = metadata.get("file_path") or metadata.get("source")
    if not isinstance(path, str) or not path:
        return None
    try:
        return str(Path(path).expanduser().resolve())
    except (OSError, RuntimeError, ValueError):
        return path


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


#: Options each retriever mode takes besides ``similarity_top_k``, ``filters``,
#: ``callback_manager`` and ``verbose`` (which every mode takes). Anything else is refused.
RETRIEVER_OPTIONS: Dict[str, tuple[str, ...]] = {
    "hybrid": ("candidate_top_k", "weights", "dense_search"),
    "hybrid_score": ("candidate_top_k", "weights", "dense_search"),
    "hybrid_rrf": ("candidate_top_k", "rrf_k", "weights", "dense_search"),
    "dense": ("dense_search",),
    "sparse": (),
    "qdrant_hybrid": ("candidate_top_k", "rrf_k", "weights"),
}
COMMON_RETRIEVER_OPTIONS: tuple[str, ...] = ("similarity_top_k", "filters", "callback_manager", "verbose")


def check_retriever_mode(mode: Any) -> str:
    """``mode`` if it names a retriever mode; else a ValueError listing the modes."""
    if mode not in RETRIEVER_MODES:
        raise ValueError(f"unknown retriever mode {mode!r}; choose one of {', '.join(RETRIEVER_MODES)}")
    return mode


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


def _query_engine_options() -> tuple[str, ...]:
    """The keywords ``RetrieverQueryEngine.from_args`` really uses (its ``**kwargs`` are dropped)."""
    import inspect

    from llama_index.core.query_engine import RetrieverQueryEngine

    params = inspect.signature(RetrieverQueryEngine.from_args).parameters
    return tuple(
        name for name, p in params.items()
        if name not in ("retriever", "llm", "self", "cls") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    )


def split_query_engine_kwargs(mode: str, kwargs: Dict[str, Any]) -> tuple[Dict[str, Any], Dict[str, Any]]:
    """Split ``as_query_engine`` keywords into (retriever options, query-engine options).

    ``callback_manager`` and ``verbose`` go to both (as in LlamaIndex); a keyword that neither
    the retriever of ``mode`` nor ``RetrieverQueryEngine.from_args`` uses raises a TypeError.
    """
    engine_names = _query_engine_options()
    retriever_names = set(COMMON_RETRIEVER_OPTIONS) | set().union(*RETRIEVER_OPTIONS.values())
    retriever_kwargs: Dict[str, Any] = {}
    engine_kwargs: Dict[str, Any] = {}
    for name, value in kwargs.items():
        if name in retriever_names:
            retriever_kwargs[name] = value
        if name in engine_names:
            engine_kwargs[name] = value
        if name not in retriever_names and name not in engine_names:
            raise TypeError(
                f"as_query_engine() got an unexpected keyword argument {name!r}: neither the {mode!r} retriever "
                f"({', '.join(COMMON_RETRIEVER_OPTIONS + RETRIEVER_OPTIONS[check_retriever_mode(mode)])}) nor "
                f"RetrieverQueryEngine.from_args ({', '.join(engine_names)}) takes it"
            )
    check_retriever_options(mode, {k: v for k, v in retriever_kwargs.items() if k not in COMMON_RETRIEVER_OPTIONS})
    return retriever_kwargs, engine_kwargs


class HybridIndex:
    """Hybrid (BM25 + dense) index in one folder, with upserts, deletes and crash safety.

    Build with :meth:`from_documents`, reopen with :meth:`load`, query with
    :meth:`as_retriever` / :meth:`as_query_engine`. Defaults: the packaged offline MiniLM
    embedding model, :class:`SectionWindowNodeParser`, Qdrant local mode inside ``storage_dir``.
    """

    def __init__(
        self,
        storage_dir: Path,
        config: Dict[str, Any],
        embed_model: BaseEmbedding,
        node_parser: NodeParser,
        client: QdrantClient,
        bm25: BM25Retriever,
        docstore: SimpleDocumentStore,
        tokenizer_config: BM25TokenizerConfig,
    ) -> None:
        self.storage_dir = storage_dir
        self.config = config
        self.embed_model = embed_model
        self.node_parser = node_parser
        self.client = client
        self.bm25 = bm25
        self.docstore = docstore
        self.tokenizer_config = tokenizer_config
        self.cache = EmbeddingCache(storage_dir / "embeddings.sqlite")
        self._vector_store: Any = None
        self._dense: Optional[tuple] = None  # (BM25 snapshot, DenseMatrix aligned with it)
        self._dense_lock = threading.Lock()
        # Write side: an update changing Qdrant/BM25/docstore; read side: queries reading Qdrant.
        self._rw_lock = ReadWriteLock()

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
    ) -> "HybridIndex":
        """Chunk, embed and index ``documents`` into a new ``storage_dir``.

        ``overwrite=True`` replaces an existing index there; otherwise an existing index is an
        error (use :meth:`load` and :meth:`upsert`).
        """
        storage = Path(storage_dir)
        if (storage / "index.json").exists():
            if not overwrite:
                raise ValueError(
                    f"{storage} already holds an index; open it with HybridIndex.load({str(storage)!r}) and "
                    "upsert(), or pass overwrite=True to rebuild it"
                )
            shutil.rmtree(storage)
        storage.mkdir(parents=True, exist_ok=True)
        embed_model = embed_model or default_embed_model()
        node_parser = node_parser or SectionWindowNodeParser()
        tokenizer_config = tokenizer_config or BM25TokenizerConfig()
        config: Dict[str, Any] = {
            "format_version": FORMAT_VERSION,
            "embed_model": embed_model_name(embed_model),
            "embed_model_class": embed_model.class_name(),
            "embed_dim": None,
            "node_parser": node_parser.to_dict(),
            "bm25": {"k1": bm25_k1, "b": bm25_b, "method": "lucene", "avgdl": None},
            "bm25_tokenizer": tokenizer_config.to_persisted(),
            "qdrant_url": qdrant_url,
            "collection": COLLECTION,
            "embed_batch_size": embed_batch_size,
            "generation": 0,
            "pending": None,
        }
        client = cls._open_client(storage, qdrant_url, qdrant_api_key)
        bm25 = BM25Retriever([], tokenizer_config=tokenizer_config, k1=bm25_k1, b=bm25_b)
        index = cls(storage, config, embed_model, node_parser, client, bm25, SimpleDocumentStore(), tokenizer_config)
        try:
            index._commit()  # generation 0: empty but valid
            index.upsert(documents, show_progress=show_progress)
            if not client.collection_exists(config["collection"]):
                # No document gave a chunk: create the collection anyway (dimension from one probe
                # embedding), so that every retriever mode answers [] instead of "not found".
                index._ensure_collection(len(embed_model.get_text_embedding("dimension probe")))
                _write_json_atomic(storage / "index.json", index.config)
        except BaseException:
            index.close()  # release the Qdrant lock: the caller never gets this object
            raise
        return index

    @classmethod
    def load(
        cls,
        storage_dir: str | Path,
        embed_model: Optional[BaseEmbedding] = None,
        node_parser: Optional[NodeParser] = None,
        qdrant_api_key: Optional[str] = None,
        custom_tokenizer: Any = None,
    ) -> "HybridIndex":
        """Open an index folder. The embedding model must be the one it was built with."""
        storage = Path(storage_dir)
        manifest = storage / "index.json"
        if not manifest.exists():
            raise ValueError(f"{storage} holds no index.json: build an index there with HybridIndex.from_documents first")
        config = json.loads(manifest.read_text(encoding="utf-8"))
        if config.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{manifest}: format_version {config.get('format_version')!r}; this version reads {FORMAT_VERSION}")
        built_with = _describe_model(config.get("embed_model_class"), config["embed_model"])
        if embed_model is None:
            if config["embed_model"] != DEFAULT_EMBED_MODEL:
                raise ValueError(
                    f"{storage} was built with embedding model {built_with}; pass "
                    f"embed_model= with that model to HybridIndex.load"
                )
            embed_model = default_embed_model()
        if embed_model_name(embed_model) != config["embed_model"]:
            given = _describe_model(embed_model.class_name(), embed_model_name(embed_model))
            raise ValueError(
                f"{storage} was built with embedding model {built_with}, not {given}: their vectors are "
                "not comparable. Load it with the model it was built with, or build a new index with this one"
            )
        node_parser = node_parser or _parser_from_dict(config["node_parser"])
        gen = config["generation"]
        bm25 = BM25Retriever.load(storage / "bm25" / f"gen-{gen}", custom_tokenizer=custom_tokenizer)
        docstore = SimpleDocumentStore.from_persist_path(str(storage / "docstore" / f"gen-{gen}.json"))
        client = cls._open_client(storage, config.get("qdrant_url"), qdrant_api_key)
        index = cls(storage, config, embed_model, node_parser, client, bm25, docstore, bm25.tokenizer_config)
        if config.get("pending"):
            try:
                index._roll_back(config["pending"])
            except BaseException:
                index.close()
                raise
        return index

    @staticmethod
    def _open_client(storage: Path, url: Optional[str], api_key: Optional[str]) -> QdrantClient:
        if url:
            return QdrantClient(url=url, api_key=api_key)
        try:
            return QdrantClient(path=str(storage / "qdrant"))
        except RuntimeError as exc:
            if "already accessed" in str(exc):
                raise IndexBusyError(storage) from None
            raise

    def close(self) -> None:
        """Release the Qdrant local-mode lock and the cache file."""
        self.client.close()
        self.cache.close()

    def __enter__(self) -> "HybridIndex":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ writes
    def upsert(
        self, documents: Sequence[Document], show_progress: bool = False, allow_source_change: bool = False
    ) -> Dict[str, int]:
        """Add or replace documents (by ``Document.id_``); unchanged chunks are not re-embedded.

        Re-indexing the same file replaces its chunks. A document whose id is already indexed
        for a *different* file (``metadata["file_path"]``, or ``source`` in folders built before
        ``file_path`` existed) is refused with :class:`DocumentIdConflictError`, since replacing it
        would silently drop the other file from the index; pass ``allow_source_change=True`` to
        replace it anyway (e.g. a file that moved).

        Returns counts: documents, chunks written, chunks removed, texts embedded.
        """
        documents = list(documents)
        for doc in documents:
            check_document_text(doc)
        ids = [d.id_ for d in documents]
        check_unique_document_ids(documents)
        if not allow_source_change:
            conflicts = [
                (doc.id_, old, new)
                for doc in documents
                for old, new in [(self._indexed_origin(doc.id_), document_origin(doc.metadata))]
                if old is not None and new is not None and old != new
            ]
            if conflicts:
                raise DocumentIdConflictError(conflicts, self.storage_dir)
        nodes = self.node_parser.get_nodes_from_documents(documents, show_progress=show_progress)
        leaves = get_leaf_nodes(nodes) if any(n.child_nodes for n in nodes) else nodes
        old_ids = set()
        for doc_id in ids:
            old_ids.update(self._node_ids_of(doc_id))
        new_ids = {n.node_id for n in nodes}
        stale = old_ids - new_ids
        cached_before = len(self.cache)
        vectors = embed_texts(
            self.embed_model,
            [n.get_content(metadata_mode=MetadataMode.EMBED) for n in leaves],
            self.cache,
            batch_size=self.config["embed_batch_size"],
            show_progress=show_progress,
        )
        embedded = len(self.cache) - cached_before
        self._ensure_collection(vectors.shape[1] if len(leaves) else None)

        with self._rw_lock.write():  # queries reading Qdrant wait: they see before or after
            self._begin(sorted(old_ids | new_ids))
            try:
                if leaves:
                    self._write_points(leaves, vectors)
                if stale:
                    self.client.delete(self.config["collection"], points_selector=models.PointIdsList(points=sorted(stale)))
                # BM25: insert_nodes replaces every indexed node of the same documents (one rebuild).
                emptied = set(ids) - {n.ref_doc_id for n in leaves}
                for doc_id in emptied:
                    self.bm25.delete_ref_doc(doc_id)
                if leaves:
                    self.bm25.insert_nodes(leaves)
                for doc_id in ids:
                    self.docstore.delete_ref_doc(doc_id, raise_error=False)
                self.docstore.add_documents(nodes, allow_update=True)
                self._commit()
            except BaseException:
                self._recover()
                raise
        logger.info("upserted %d documents: %d chunks, %d stale removed, %d embedded", len(ids), len(nodes), len(stale), embedded)
        return {"documents": len(ids), "chunks": len(nodes), "removed": len(stale), "embedded": embedded}

    def delete(self, doc_id: str) -> int:
        """Remove a document's chunks from every leg; returns how many were removed."""
        node_ids = sorted(self._node_ids_of(doc_id))
        if not node_ids:
            raise ValueError(f"no document {doc_id!r} in {self.storage_dir} (known ids: {self.doc_ids()[:10]}...)")
        with self._rw_lock.write():
            self._begin(node_ids)
            try:
                self.client.delete(self.config["collection"], points_selector=models.PointIdsList(points=node_ids))
                self.bm25.delete_ref_doc(doc_id)
                self.docstore.delete_ref_doc(doc_id, raise_error=False)
                self._commit()
            except BaseException:
                self._recover()
                raise
        return len(node_ids)

    def _node_ids_of(self, doc_id: str) -> List[str]:
        info = self.docstore.get_ref_doc_info(doc_id)
        return list(info.node_ids) if info else []

    def _indexed_origin(self, doc_id: str) -> Optional[str]:
        """The file an indexed document came from (see :func:`document_origin`), if known."""
        for node_id in self._node_ids_of(doc_id):
            node = self.docstore.get_node(node_id, raise_error=False)
            if node is not None:
                return document_origin(node.metadata)
        return None

    def document_origins(self) -> Dict[str, Optional[str]]:
        """Each indexed document id with the absolute path of the file it came from (None if unknown)."""
        return {doc_id: self._indexed_origin(doc_id) for doc_id in self.doc_ids()}

    def doc_ids(self) -> List[str]:
        """The ids of the indexed documents."""
        return sorted((self.docstore.get_all_ref_doc_info() or {}).keys())

    def _ensure_collection(self, dim: Optional[int]) -> None:
        name = self.config["collection"]
        if self.client.collection_exists(name):
            if dim is not None and self.config["embed_dim"] not in (None, dim):
                raise ValueError(f"embedding dimension {dim} differs from the index's {self.config['embed_dim']}")
            return
        if dim is None:
            return
        self.client.create_collection(
            name,
            vectors_config={DENSE_VECTOR: models.VectorParams(size=dim, distance=models.Distance.COSINE)},
            sparse_vectors_config=sparse_vectors_config(),
        )
        self.config["embed_dim"] = dim

    def _write_points(self, leaves: Sequence[BaseNode], vectors: Any) -> None:
        bm25cfg = self.config["bm25"]
        # Unit-length vectors: cosine does not care, and Qdrant local mode (qdrant-client 1.20)
        # normalises vectors on upsert but not when it reloads the collection from disk, so a
        # model that returns non-unit vectors would score differently after every reopen.
        vectors = np.asarray(vectors, dtype=np.float32)
        norms = np.linalg.norm(vectors, axis=1, keepdims=True)
        vectors = vectors / np.where(norms > 0, norms, 1.0)
        tokens = [self.bm25.tokenize(n.get_content()) for n in leaves]
        if bm25cfg["avgdl"] is None:
            bm25cfg["avgdl"] = max(1.0, sum(len(t) for t in tokens) / max(1, len(tokens)))
        points = [
            models.PointStruct(
                id=node.node_id,
                vector={
                    DENSE_VECTOR: vec.tolist(),
                    SPARSE_VECTOR: bm25_doc_vector(tok, bm25cfg["avgdl"], bm25cfg["k1"], bm25cfg["b"]),
                },
                payload=node_to_metadata_dict(node, remove_text=False, flat_metadata=False),
            )
            for node, vec, tok in zip(leaves, vectors, tokens)
        ]
        for i in range(0, len(points), 256):
            self.client.upsert(self.config["collection"], points=points[i : i + 256], wait=True)

    def _begin(self, touched_ids: Sequence[str]) -> None:
        """Record what the next write touches, so a crash can be rolled back on open.

        An unfinished earlier write (its roll-back failed) keeps its ids in the journal: the
        journal only ever grows until a commit, so no touched chunk is forgotten.
        """
        touched = set(touched_ids)
        pending = self.config.get("pending")
        if pending:
            touched.update(pending.get("touched_ids", []))
        self.config["pending"] = {"generation": self.config["generation"] + 1, "touched_ids": sorted(touched)}
        _write_json_atomic(self.storage_dir / "index.json", self.config)

    def _recover(self) -> None:
        """After a failed write: read the committed generation again and roll Qdrant back to it.

        A write changes BM25 and the docstore in memory before it commits, so without this the
        live object would keep serving the half-done write. Best effort: when recovery fails too,
        the journal stays in index.json and :meth:`load` rolls back on the next open.
        """
        try:
            config = json.loads((self.storage_dir / "index.json").read_text(encoding="utf-8"))
            gen = config["generation"]
            committed = BM25Retriever.load(
                self.storage_dir / "bm25" / f"gen-{gen}", custom_tokenizer=self.tokenizer_config.custom_tokenizer
            )
            docstore = SimpleDocumentStore.from_persist_path(str(self.storage_dir / "docstore" / f"gen-{gen}.json"))
            # Swap the state in place, so retrievers made earlier (BM25 views) see it too.
            with self.bm25._shared.lock:
                self.bm25._shared.snapshot = committed._shared.snapshot
            self.docstore = docstore
            self.config = config
            self._dense = None
            if config.get("pending"):
                self._roll_back(config["pending"])
        except Exception:
            logger.exception("%s: could not roll back the failed write in this process; HybridIndex.load will", self.storage_dir)

    def _commit(self) -> None:
        """Write the next generation's BM25 and docstore, then switch index.json to it."""
        gen = self.config["generation"] + (1 if self.config.get("pending") else 0)
        if not (self.storage_dir / "index.json").exists():
            gen = 0
        self.bm25.persist(self.storage_dir / "bm25" / f"gen-{gen}")
        (self.storage_dir / "docstore").mkdir(parents=True, exist_ok=True)
        self.docstore.persist(str(self.storage_dir / "docstore" / f"gen-{gen}.json"))
        old = self.config["generation"]
        self.config["generation"] = gen
        self.config["pending"] = None
        _write_json_atomic(self.storage_dir / "index.json", self.config)
        self._dense = None
        if old != gen:
            shutil.rmtree(self.storage_dir / "bm25" / f"gen-{old}", ignore_errors=True)
            (self.storage_dir / "docstore" / f"gen-{old}.json").unlink(missing_ok=True)

    def _roll_back(self, pending: Dict[str, Any]) -> None:
        """Make Qdrant agree with the committed docstore for the ids an unfinished write touched."""
        touched = pending.get("touched_ids", [])
        logger.warning("%s: the last update did not finish; restoring %d chunk(s) of the committed index", self.storage_dir, len(touched))
        keep = [self.docstore.docs[i] for i in touched if i in self.docstore.docs]
        keep_ids = {n.node_id for n in keep}
        drop = [i for i in touched if i not in keep_ids]
        if drop and self.client.collection_exists(self.config["collection"]):
            self.client.delete(self.config["collection"], points_selector=models.PointIdsList(points=drop))
        leaves = [n for n in keep if not n.child_nodes]
        if leaves:
            vectors = embed_texts(self.embed_model, [n.get_content(metadata_mode=MetadataMode.EMBED) for n in leaves], self.cache)
            self._ensure_collection(vectors.shape[1])
            self._write_points(leaves, vectors)
        nxt = pending.get("generation")
        shutil.rmtree(self.storage_dir / "bm25" / f"gen-{nxt}", ignore_errors=True)
        (self.storage_dir / "docstore" / f"gen-{nxt}.json").unlink(missing_ok=True)
        self.config["pending"] = None
        _write_json_atomic(self.storage_dir / "index.json", self.config)
        self._dense = None

    # ------------------------------------------------------------------ reads
    @property
    def vector_store(self) -> Any:
        """The collection as a LlamaIndex ``QdrantVectorStore`` (dense vectors)."""
        if self._vector_store is None:
            from llama_index.vector_stores.qdrant import QdrantVectorStore

            self._vector_store = QdrantVectorStore(collection_name=self.config["collection"], client=self.client)
        return self._vector_store

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

        * ``"hybrid"`` (recommended): BM25 + dense, fused in process by the method that measured
          best (docs/benchmarks.md): today score fusion, i.e. ``"hybrid_score"``;
        * ``"hybrid_score"``: convex combination of min-max normalised leg scores (``weights``);
        * ``"hybrid_rrf"``: reciprocal rank fusion, ``sum w / (rrf_k + rank)``;
        * ``"dense"``, ``"sparse"`` (BM25): one leg;
        * ``"qdrant_hybrid"``: RRF inside Qdrant (the path for a Qdrant server or cluster).

        Every mode takes ``similarity_top_k``, ``filters``, ``callback_manager`` and ``verbose``.
        ``filters`` mean the same in every mode: they are evaluated on each chunk's metadata
        (``metadata["doc_id"]``, not Qdrant's payload copy of ``Document.id_``) by
        :func:`~llama_index_retrieval_kit.retrievers.filters.metadata_matches`, and Qdrant is
        asked for exactly the matching chunks. Further options, per mode (:data:`RETRIEVER_OPTIONS`):
        ``candidate_top_k`` (each leg's depth, default 100), ``weights`` (per leg, ``[bm25,
        dense]``), ``rrf_k`` (default 60), ``dense_search``: ``"memory"`` (exact cosine over the
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
        if dense_search not in DENSE_SEARCH:
            raise ValueError(f"unknown dense_search {dense_search!r}; choose one of {', '.join(DENSE_SEARCH)}")
        candidate_top_k = check_positive_int("candidate_top_k", given.get("candidate_top_k", 100))
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
            return QdrantHybridRetriever(
                self.client,
                self.config["collection"],
                self.embed_model,
                self.bm25.tokenize,
                similarity_top_k=similarity_top_k,
                candidate_top_k=depth,
                rrf_k=rrf_k,  # QdrantHybridRetriever rejects a non-integer k instead of truncating it
                filters=filters,
                point_filter=self._point_filter(filters),
                read_guard=self._rw_lock.read,
                **common,
            )
        fusion = "rrf" if mode == "hybrid_rrf" else "score"
        if self._dense_in_memory(dense_search):
            return FusedIndexRetriever(
                self._bm25_view(filters, depth),
                self.dense_matrix,
                self.embed_model,
                mode=fusion,
                rrf_k=rrf_k,
                weights=weights,
                candidate_top_k=depth,
                similarity_top_k=similarity_top_k,
                **common,
            )
        legs = [self._bm25_view(filters, depth), self._dense_retriever(filters, depth, dense_search)]
        return HybridRetriever(
            legs,
            names=["bm25", "dense"],
            mode=fusion,
            rrf_k=rrf_k,
            weights=weights,
            similarity_top_k=similarity_top_k,
            **common,
        )

    def _dense_in_memory(self, dense_search: str) -> bool:
        return dense_search == "memory" or (dense_search == "auto" and not self.config.get("qdrant_url"))

    def _bm25_view(self, filters: Optional[MetadataFilters], top_k: int, **common: Any) -> BM25Retriever:
        return self.bm25.with_filters(filters, similarity_top_k=top_k, **common)

    def _dense_retriever(
        self, filters: Optional[MetadataFilters], top_k: int, dense_search: str = "auto", **common: Any
    ) -> BaseRetriever:
        if self._dense_in_memory(dense_search):
            return ExactDenseRetriever(self.dense_matrix, self.embed_model, similarity_top_k=top_k, filters=filters, **common)
        return QdrantDenseRetriever(
            self.client,
            self.config["collection"],
            self.embed_model,
            similarity_top_k=top_k,
            filters=filters,
            point_filter=self._point_filter(filters),
            read_guard=self._rw_lock.read,
            **common,
        )

    def _point_filter(self, filters: Optional[MetadataFilters]) -> Optional[Callable[[], Any]]:
        """For Qdrant-side search: a callable giving the Qdrant filter that admits exactly the
        chunks ``filters`` matches, evaluated on the indexed chunks' metadata as every in-memory
        leg does (one meaning for a filter in every mode). Cached per index state."""
        if filters is None:
            return None
        cache: Dict[str, Any] = {"snapshot": None, "filter": None}

        def point_filter() -> Any:
            snapshot = self.bm25.snapshot
            if cache["snapshot"] is not snapshot:
                allowed, excluded = [], []
                for node in snapshot.nodes:
                    (allowed if metadata_matches(node.metadata, filters) else excluded).append(node.node_id)
                cache["filter"], cache["snapshot"] = point_ids_filter(allowed, excluded), snapshot
            return cache["filter"]

        return point_filter

    def dense_matrix(self, snapshot: Any = None) -> DenseMatrix:
        """The indexed dense vectors as a matrix whose rows follow the BM25 index's node order.

        Read from Qdrant once per index generation. Local mode answers dense queries from it: the
        same exact cosine search Qdrant local mode runs, without its per-point Python work, and
        with positions shared with BM25 so that fusion runs on arrays. It holds a second copy of
        the vectors in memory (4 bytes x dimension per chunk: 1.5 GB per million MiniLM chunks).
        """
        snapshot = snapshot if snapshot is not None else self.bm25._shared.snapshot
        cached = self._dense
        if cached is not None and cached[0] is snapshot:
            return cached[1]
        with self._dense_lock:
            cached = self._dense
            if cached is not None and cached[0] is snapshot:
                return cached[1]
            matrix, complete = self._read_dense_matrix(snapshot)
            if complete:
                self._dense = (snapshot, matrix)
            return matrix

    def _read_dense_matrix(self, snapshot: Any) -> tuple[DenseMatrix, bool]:
        name = self.config["collection"]
        dim = self.config.get("embed_dim") or 1
        nodes = snapshot.nodes
        if not nodes or not self.client.collection_exists(name):
            return DenseMatrix.build(nodes, np.zeros((len(nodes), dim), dtype=np.float32)), True
        stored: Dict[str, Any] = {}
        offset = None
        with self._rw_lock.read():  # all pages from one state of Qdrant
            while True:
                points, offset = self.client.scroll(
                    name, limit=SCROLL_PAGE, offset=offset, with_payload=False, with_vectors=[DENSE_VECTOR]
                )
                for point in points:
                    stored[str(point.id)] = point.vector[DENSE_VECTOR]
                if offset is None:
                    break
        missing = [n.node_id for n in nodes if n.node_id not in stored]
        extra = len(stored) - (len(nodes) - len(missing))
        vectors = np.zeros((len(nodes), dim), dtype=np.float32)
        for row, node in enumerate(nodes):
            vec = stored.get(node.node_id)
            if vec is not None:
                vectors[row] = vec
        complete = not missing and not extra
        if not complete:
            # Seen only while a write is between its Qdrant and BM25 steps, or in a folder changed
            # outside HybridIndex: answer with what is there and read again on the next query.
            logger.warning(
                "%s: Qdrant and BM25 disagree (%d chunk(s) without a vector, %d vector(s) without a chunk); "
                "if no update is running, rebuild the folder with from_documents(..., overwrite=True)",
                self.storage_dir,
                len(missing),
                extra,
            )
        logger.debug("dense matrix: %d vectors read from Qdrant", len(stored))
        return DenseMatrix.build(nodes, vectors), complete

    def as_query_engine(self, llm: Any = None, mode: str = "hybrid", similarity_top_k: int = 5, **kwargs: Any) -> Any:
        """A ``RetrieverQueryEngine`` over :meth:`as_retriever`; ``llm`` defaults to ``Settings.llm``.

        As with ``VectorStoreIndex.as_query_engine``, retriever options (``filters``,
        ``candidate_top_k``, ...; see :meth:`as_retriever`) go to the retriever and the
        rest to ``RetrieverQueryEngine.from_args`` (``node_postprocessors``, ``response_mode``,
        ``text_qa_template``, ``streaming``, ...); ``callback_manager`` and ``verbose`` go to both.
        A keyword neither takes is refused (``TypeError``), never dropped.
        """
        from llama_index.core import Settings
        from llama_index.core.query_engine import RetrieverQueryEngine

        retriever_kwargs, engine_kwargs = split_query_engine_kwargs(mode, kwargs)
        if llm is None and getattr(Settings, "_llm", None) is None:
            raise ValueError(
                "as_query_engine needs an LLM: pass llm=... (any LlamaIndex LLM) or set "
                "llama_index.core.Settings.llm; this package never falls back to a paid API"
            )
        retriever = self.as_retriever(mode=mode, similarity_top_k=similarity_top_k, **retriever_kwargs)
        return RetrieverQueryEngine.from_args(retriever, llm=llm, **engine_kwargs)
