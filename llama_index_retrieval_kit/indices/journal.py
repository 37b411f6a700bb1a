"""The write journal of a ``HybridIndex`` folder: generations, the pending-write record, commits.

A folder's committed state is generation N: ``bm25/gen-N/`` and ``docstore/gen-N.json``, named
by ``index.json`` (:class:`.manifest.IndexManifest`). A write runs in four steps, each durable
before the next:

1. :meth:`WriteJournal.begin` records in ``index.json`` the write to come: ``pending =
   {generation: N + 1, touched_ids}``. An unfinished earlier write's ids are kept: the record only
   grows until a commit, so no touched chunk is forgotten.
2. The index changes the point store and, in memory, BM25 and the docstore.
3. :meth:`WriteJournal.commit` writes generation N + 1's files, fsyncs them, then switches
   ``index.json`` to N + 1 (journal cleared, checksums recorded) in one rename, and deletes the
   other generations' files.
4. Killed between 1 and 3, the folder still names generation N with its record: the next open
   rewrites the touched points from generation N's docstore (:func:`split_touched` says which to
   rewrite and which to delete; the index does it, with vectors from the embedding cache), then
   :meth:`WriteJournal.finish_roll_back` deletes N + 1's files and clears the record.

Nothing here touches the point store or embeds: the index does that between the steps.
"""

from __future__ import annotations

import functools
import logging
import pickle
import sqlite3
import zipfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

from llama_index.core.schema import BaseNode
from llama_index.core.storage.docstore import SimpleDocumentStore

from ..retrievers.bm25 import BM25Retriever
from . import storage
from .docstore import IndexDocumentStore
from .manifest import FORMAT_VERSION, GenerationRecord, IndexManifest, PendingWrite

logger = logging.getLogger(__name__)

#: Errors of reading damaged files (zip, numpy, JSON, pickle, SQLite) that mean "damaged folder".
READ_ERRORS = (
    OSError,
    EOFError,
    KeyError,
    IndexError,
    TypeError,
    AttributeError,
    UnicodeDecodeError,
    zipfile.BadZipFile,
    pickle.UnpicklingError,
    sqlite3.DatabaseError,
)


def read_generation(
    storage_dir: Path, generation: int, custom_tokenizer: Any = None, defer_docstore: bool = False
) -> Tuple[BM25Retriever, Union[SimpleDocumentStore, Callable[[], SimpleDocumentStore]]]:
    """Load generation ``generation``'s BM25 index and docstore; unreadable files are a
    :class:`.storage.DamagedIndexError` naming the file.

    ``defer_docstore``: the docstore file is read now (a later commit of another process may
    delete it) but parsed only when the returned callable is called (:func:`parse_docstore`):
    an index that only answers queries never parses it (4 s and over 1 GB of objects at 162k
    chunks). Use it only for files whose checksum was verified: their parse cannot fail."""
    with storage.paused_gc():  # every node of the index is parsed: bulk allocation
        bm25 = _read_bm25(storage_dir, generation, custom_tokenizer)
        path = storage.docstore_file(storage_dir, generation)
        try:
            raw = path.read_bytes()
        except READ_ERRORS as exc:
            raise storage.DamagedIndexError(path, f"cannot be read ({type(exc).__name__}: {exc})", storage_dir) from exc
        if defer_docstore:
            return bm25, functools.partial(parse_docstore, raw, path, storage_dir)
        return bm25, parse_docstore(raw, path, storage_dir)


def parse_docstore(raw: bytes, path: Path, storage_dir: Path) -> IndexDocumentStore:
    """The docstore in ``raw`` (the bytes of ``path``); unreadable, a DamagedIndexError naming it."""
    with storage.paused_gc():
        try:
            docstore = IndexDocumentStore.from_json_bytes(raw)
            docstore.get_all_ref_doc_info()  # parses the structure
        except (ValueError, *READ_ERRORS) as exc:
            raise storage.DamagedIndexError(path, f"cannot be read ({type(exc).__name__}: {exc})", storage_dir) from exc
    return docstore


def _read_bm25(storage_dir: Path, generation: int, custom_tokenizer: Any) -> BM25Retriever:
    folder = storage.bm25_dir(storage_dir, generation)
    try:
        return BM25Retriever.load(folder, custom_tokenizer=custom_tokenizer)
    except ValueError as exc:
        if "custom tokenizer" in str(exc):  # a usage error (load(custom_tokenizer=...)), not damage
            raise
        raise storage.DamagedIndexError(folder, f"cannot be read ({type(exc).__name__}: {exc})", storage_dir) from exc
    except READ_ERRORS as exc:
        raise storage.DamagedIndexError(folder, f"cannot be read ({type(exc).__name__}: {exc})", storage_dir) from exc


def split_touched(touched_ids: Iterable[str], committed: Mapping[str, BaseNode]) -> Tuple[List[BaseNode], List[str]]:
    """What a roll-back does with the ids an unfinished write touched: ``(keep, drop)``, the
    committed nodes among them (their points are rewritten) and the ids the committed docstore
    does not hold (their points are deleted), both in ``touched_ids`` order."""
    touched = list(touched_ids)
    keep = [committed[i] for i in touched if i in committed]
    kept = {n.node_id for n in keep}
    return keep, [i for i in touched if i not in kept]


class WriteJournal:
    """``index.json`` of one folder as the journal of its writes (see the module docstring).

    Holds the manifest in memory (:attr:`manifest`): :meth:`amend` changes it there, to be written
    with the next record or commit; :meth:`save` writes it now.
    """

    def __init__(self, storage_dir: Path | str, manifest: IndexManifest) -> None:
        self.storage_dir = Path(storage_dir)
        self._manifest = manifest

    @property
    def path(self) -> Path:
        """The folder's ``index.json``."""
        return self.storage_dir / storage.MANIFEST

    @property
    def manifest(self) -> IndexManifest:
        """The manifest as this process knows it (the committed one plus in-memory amendments)."""
        return self._manifest

    @property
    def pending(self) -> Optional[PendingWrite]:
        """The record of an unfinished write, or None."""
        return self._manifest.pending

    def amend(self, manifest: IndexManifest) -> None:
        """Adopt ``manifest`` in memory; it reaches the disk with the next :meth:`save`."""
        self._manifest = manifest

    def save(self, manifest: IndexManifest) -> None:
        """Write ``manifest`` to ``index.json`` in one rename, then adopt it. Adopted only once
        written: when the write fails, memory and disk both keep the previous manifest, so this
        object never acts on a state the folder does not record (e.g. a server it did not switch to)."""
        manifest.write(self.path)
        self._manifest = manifest

    def read_disk(self) -> IndexManifest:
        """``index.json`` as it is on disk now (another process may have committed since)."""
        return IndexManifest.read(self.path, FORMAT_VERSION, self.storage_dir)

    def begin(self, touched_ids: Iterable[str]) -> PendingWrite:
        """Record, durably, that a write touching ``touched_ids`` starts (merged with an unfinished
        record's ids: the record only grows until a commit)."""
        touched = set(touched_ids)
        if self.pending is not None:
            touched.update(self.pending.touched_ids)
        record = PendingWrite(generation=self._manifest.generation + 1, touched_ids=tuple(sorted(touched)))
        self.save(self._manifest.with_pending(record))
        return record

    def commit(self, bm25: BM25Retriever, docstore: SimpleDocumentStore) -> int:
        """Write the next generation's BM25 and docstore files (0 in a folder without ``index.json``),
        fsync them, switch ``index.json`` to that generation, delete the others; returns it."""
        manifest = self._manifest
        generation = manifest.generation + (1 if manifest.pending is not None else 0)
        if not self.path.exists():
            generation = 0
        bm25_dir = storage.bm25_dir(self.storage_dir, generation)
        docstore_file = storage.docstore_file(self.storage_dir, generation)
        bm25.persist(bm25_dir)
        docstore_file.parent.mkdir(parents=True, exist_ok=True)
        docstore.persist(str(docstore_file))
        storage.fsync_tree(bm25_dir)  # on disk before index.json names them
        storage.fsync_tree(docstore_file)
        record = GenerationRecord.model_validate(storage.generation_record(self.storage_dir, generation, chunks=len(bm25)))
        self.save(manifest.committed(generation, record))
        self._remove_generations_but(generation)
        return generation

    def discard_pending(self, pending: PendingWrite) -> None:
        """Delete the files an unfinished write left for its generation and clear its record in
        memory (the caller has restored the point store, or is rebuilding it)."""
        storage.remove_path(storage.bm25_dir(self.storage_dir, pending.generation))
        storage.remove_path(storage.docstore_file(self.storage_dir, pending.generation))
        self.amend(self._manifest.with_pending(None))

    def finish_roll_back(self, pending: PendingWrite) -> None:
        """After the point store was restored to the committed state: :meth:`discard_pending` and
        clear the record in ``index.json``. When that write fails, only the record is left there
        (rolling back again is harmless); the next write or writable open clears it."""
        self.discard_pending(pending)
        try:
            self.save(self._manifest)
        except OSError as exc:
            logger.warning("%s: rolled back, but could not clear the journal in index.json (%s)", self.storage_dir, exc)

    def _remove_generations_but(self, generation: int) -> None:
        """Delete every generation's files but ``generation``'s: the previous one, and any left by a
        crash after a switch."""
        found: Dict[int, List[Path]] = storage.generation_paths(self.storage_dir)
        for old, paths in found.items():
            if old != generation:
                for path in paths:
                    storage.remove_path(path)
