"""The docstore of a ``HybridIndex``: LlamaIndex's ``SimpleDocumentStore``, with a bulk-friendly
insert and a persist that encodes only what changed.

:class:`IndexDocumentStore` is a ``SimpleDocumentStore`` (same methods, same persisted JSON: a
folder written by either reads with either). It changes two things:

* LlamaIndex serialises each inserted node's ``RefDocInfo`` through ``dataclasses_json``
  (``RefDocInfo.to_dict``), which was the largest single cost of indexing (measured: 80% of
  ``add_documents``, about 0.3 ms per chunk at 20,000 chunks). Here the same dict is built
  directly: ``{"node_ids": [...], "metadata": {...}}``, both copied (lists and dicts at every
  depth), as ``to_dict`` copies them.
* Its key-value store is a :class:`FragmentCachingKVStore`: ``SimpleKVStore.persist`` encodes
  every entry at every call (0.6 s at 32,000 chunks, for a one-document upsert); this one keeps
  each entry's JSON and encodes only entries stored since the last persist. The file is
  byte-identical to ``SimpleKVStore.persist``'s.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import fsspec
from llama_index.core.schema import BaseNode
from llama_index.core.storage.docstore import SimpleDocumentStore
from llama_index.core.storage.docstore.types import DEFAULT_BATCH_SIZE, RefDocInfo
from llama_index.core.storage.kvstore.simple_kvstore import SimpleKVStore
from llama_index.core.storage.kvstore.types import DEFAULT_COLLECTION

from .._json_fragments import FragmentCache, dict_item_json, dict_key_json
from ..retrievers.node_copy import copy_metadata

logger = logging.getLogger(__name__)


def json_copy(value: Any) -> Any:
    """A copy of a JSON-like value: dicts, lists and tuples copied at every depth (tuples become
    lists, as ``dataclasses_json`` makes them), anything else shared (immutable scalars)."""
    kind = type(value)
    if kind is dict:
        return {k: json_copy(v) for k, v in value.items()}
    if kind is list or kind is tuple:
        return [json_copy(v) for v in value]
    return value


#: A stored value's private copy: containers copied at every depth, immutable scalars shared,
#: anything else deep-copied (the package's one copier of JSON-like values).
private_copy = copy_metadata


def _entry_json(key: Any, entry: Any) -> bytes:
    """One stored entry as ``SimpleKVStore.persist`` writes it inside its collection."""
    return dict_item_json(key, entry).encode("utf-8")


class FragmentCachingKVStore(SimpleKVStore):
    """A ``SimpleKVStore`` whose persist encodes only the entries stored since the last persist.

    Why a cached encoding can never be stale: an entry object is only ever reachable from this
    store. ``put`` stores a private copy (:func:`private_copy`, a new object at every put),
    ``get``/``get_all``/``to_dict`` return private copies, and loading adopts freshly parsed
    JSON. So no caller can change a stored entry in place (not even through the nested lists of
    a node read back from the docstore, which LlamaIndex's ``json_to_doc`` shares with the entry
    it reads), and an entry whose object is unchanged has unchanged content.

    Differences from ``SimpleKVStore``, all on the safe side: a caller changing what it put or
    got (at any depth) no longer changes the store, and dict/list subclasses come back as
    copies of their own type.
    """

    def __init__(self, data: Optional[Dict[str, Dict[str, dict]]] = None) -> None:
        super().__init__(None if data is None else {name: private_copy(entries) for name, entries in data.items()})
        self._json_by_collection: Dict[str, FragmentCache[str]] = {}

    # Entries in and out: private copies (see the class docstring).

    def put(self, key: str, val: dict, collection: str = DEFAULT_COLLECTION) -> None:
        super().put(key, private_copy(val), collection=collection)

    def adopt_all(self, kv_pairs: Sequence[Tuple[str, dict]], collection: str = DEFAULT_COLLECTION) -> None:
        """Store each ``(key, entry)`` as ``put`` does, but the entry itself, not a copy: for entries
        nothing else holds (built for this call, as a docstore insert builds them)."""
        for key, val in kv_pairs:
            SimpleKVStore.put(self, key, val, collection=collection)

    def get(self, key: str, collection: str = DEFAULT_COLLECTION) -> Optional[dict]:
        value = super().get(key, collection=collection)
        return None if value is None else private_copy(value)

    def get_all(self, collection: str = DEFAULT_COLLECTION) -> Dict[str, dict]:
        return {key: private_copy(value) for key, value in super().get_all(collection=collection).items()}

    def to_dict(self) -> dict:
        return {name: private_copy(entries) for name, entries in super().to_dict().items()}

    # Persistence.

    def persist(self, persist_path: str, fs: Optional[fsspec.AbstractFileSystem] = None) -> None:
        """Write the store as ``SimpleKVStore.persist`` does (same path and ``fs`` handling, same
        bytes), encoding only entries not encoded by an earlier persist."""
        pieces = self.persisted_pieces()
        fs = fs or fsspec.filesystem("file")
        dirpath = os.path.dirname(persist_path)
        if not fs.exists(dirpath):
            fs.makedirs(dirpath)
        with fs.open(persist_path, "wb") as f:
            for piece in pieces:
                f.write(piece)

    def persisted_pieces(self) -> List[bytes]:
        """The persisted file's bytes in pieces (three per collection; the file is never built
        as one object): ``b"".join(pieces) == json.dumps(store.to_dict()).encode()``."""
        # {name: the stored mapping}, each mapping's items listed at once (a put from another
        # thread cannot change them under the loop below; the loop changes nothing).
        collections = {name: list(entries.items()) for name, entries in super().to_dict().items()}
        caches = {name: self._json_by_collection.get(name, None) for name in collections}
        caches = {name: FragmentCache() if cache is None else cache for name, cache in caches.items()}
        pieces: List[bytes] = [b"{"]
        for position, (name, entries) in enumerate(collections.items()):
            fragments = caches[name].fragments(entries, _entry_json)
            head = (", " if position else "") + dict_key_json(name) + "{"
            pieces += [head.encode("utf-8"), b", ".join(fragments), b"}"]
        pieces.append(b"}")
        self._json_by_collection = caches
        return pieces

    def cached_json_bytes(self) -> int:
        """Bytes of JSON held for the next persist (the memory this store adds to ``SimpleKVStore``)."""
        return sum(cache.cached_bytes() for cache in self._json_by_collection.values())

    @classmethod
    def from_persist_path(
        cls, persist_path: str, fs: Optional[fsspec.AbstractFileSystem] = None
    ) -> "FragmentCachingKVStore":
        """Load a store written by ``SimpleKVStore.persist`` (or this class's)."""
        fs = fs or fsspec.filesystem("file")
        logger.debug("loading a key-value store from %s", persist_path)
        with fs.open(persist_path, "rb") as f:
            return cls.from_json_bytes(f.read())

    @classmethod
    def from_json_bytes(cls, raw: bytes) -> "FragmentCachingKVStore":
        """The store in ``raw``, the bytes of a file ``persist`` wrote (entries adopted, not copied)."""
        return cls.adopting(json.loads(raw))

    @classmethod
    def adopting(cls, data: Dict[str, Dict[str, dict]]) -> "FragmentCachingKVStore":
        """A store holding ``data``'s entries themselves, not copies: for data nothing else holds
        (just parsed). ``cls(data)`` copies instead."""
        if not isinstance(data, dict):
            raise ValueError(f"a key-value store's data must be a dict of collections, got {type(data).__name__}")
        store = cls()
        for name, entries in data.items():
            if not isinstance(entries, dict):
                raise ValueError(f"collection {name!r} must be a dict of entries, got {type(entries).__name__}")
            SimpleKVStore.get_all(store, collection=name)  # creates the collection, even an empty one
            wrong = next((key for key, entry in entries.items() if not isinstance(entry, dict)), None)
            if wrong is not None:
                raise ValueError(f"entry {wrong!r} of collection {name!r} must be a dict, got {type(entries[wrong]).__name__}")
            store.adopt_all(list(entries.items()), collection=name)
        return store

    def __getstate__(self) -> dict:
        state = super().__getstate__()
        state.pop("_json_by_collection", None)
        return state

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        self._json_by_collection = {}


def ref_doc_info_dict(info: RefDocInfo) -> dict:
    """``info.to_dict()`` (dataclasses_json) without dataclasses_json: its two fields, copied."""
    return {"node_ids": json_copy(info.node_ids), "metadata": json_copy(info.metadata)}


class IndexDocumentStore(SimpleDocumentStore):
    """``SimpleDocumentStore`` whose inserts skip ``dataclasses_json`` and whose persist encodes
    only what changed (see the module docstring).

    Built without a key-value store (or loaded with ``from_persist_path``/``from_persist_dir``/
    ``from_dict``) it uses a :class:`FragmentCachingKVStore`; given another ``SimpleKVStore`` it
    uses that one, shared with the caller, and persists as ``SimpleDocumentStore`` does.
    """

    def __init__(
        self,
        simple_kvstore: Optional[SimpleKVStore] = None,
        namespace: Optional[str] = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
    ) -> None:
        kvstore = simple_kvstore if simple_kvstore is not None else FragmentCachingKVStore()
        super().__init__(kvstore, namespace=namespace, batch_size=batch_size)

    @classmethod
    def from_persist_path(
        cls,
        persist_path: str,
        namespace: Optional[str] = None,
        fs: Optional[fsspec.AbstractFileSystem] = None,
    ) -> "IndexDocumentStore":
        """Load a docstore file written by ``SimpleDocumentStore.persist`` (or this class's)."""
        return cls(FragmentCachingKVStore.from_persist_path(persist_path, fs=fs), namespace)

    @classmethod
    def from_json_bytes(cls, raw: bytes, namespace: Optional[str] = None) -> "IndexDocumentStore":
        """A docstore from the bytes of a file ``persist`` wrote (as :meth:`from_persist_path`
        reads it)."""
        return cls(FragmentCachingKVStore.from_json_bytes(raw), namespace)

    @classmethod
    def from_dict(cls, save_dict: dict, namespace: Optional[str] = None) -> "IndexDocumentStore":
        """A docstore holding a copy of ``save_dict`` (``SimpleDocumentStore.to_dict``'s form)."""
        return cls(FragmentCachingKVStore(save_dict), namespace)

    def add_documents(
        self,
        docs: Sequence[BaseNode],
        allow_update: bool = True,
        batch_size: Optional[int] = None,
        store_text: bool = True,
    ) -> None:
        """``SimpleDocumentStore.add_documents``; with its own key-value store the entries built
        here (``node.to_dict()``, fresh at every depth, and the dicts around it) are stored
        without a second copy (:meth:`FragmentCachingKVStore.adopt_all`)."""
        if not isinstance(self._kvstore, FragmentCachingKVStore):
            super().add_documents(docs, allow_update=allow_update, batch_size=batch_size, store_text=store_text)
            return
        node_pairs, metadata_pairs, ref_doc_pairs = self._prepare_kv_pairs(docs, allow_update, store_text)
        self._kvstore.adopt_all(node_pairs, collection=self._node_collection)
        self._kvstore.adopt_all(metadata_pairs, collection=self._metadata_collection)
        self._kvstore.adopt_all(ref_doc_pairs, collection=self._ref_doc_collection)

    def _get_kv_pairs_for_insert(
        self, node: BaseNode, ref_doc_info: Optional[RefDocInfo], store_text: bool
    ) -> Tuple[Optional[Tuple[str, dict]], Optional[Tuple[str, dict]], Optional[Tuple[str, dict]]]:
        if ref_doc_info is None or not node.ref_doc_id:
            return super()._get_kv_pairs_for_insert(node, ref_doc_info, store_text)
        # LlamaIndex's own steps for a node of a document, with ref_doc_info_dict for to_dict().
        if node.node_id not in ref_doc_info.node_ids:
            ref_doc_info.node_ids.append(node.node_id)
        if not ref_doc_info.metadata:
            ref_doc_info.metadata = node.metadata or {}
        node_pair, metadata_pair, _ = super()._get_kv_pairs_for_insert(node, None, store_text)
        key, metadata = metadata_pair if metadata_pair is not None else (node.node_id, {"doc_hash": node.hash})
        metadata["ref_doc_id"] = node.ref_doc_id
        return node_pair, (key, metadata), (node.ref_doc_id, ref_doc_info_dict(ref_doc_info))
