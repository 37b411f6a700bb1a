"""Safety of a ``HybridIndex`` storage folder: manifest validation, checksums, locks, durable writes.

What :class:`~llama_index_retrieval_kit.indices.HybridIndex` uses to treat its folder as untrusted
input and to write it safely:

* :func:`read_manifest` / :func:`validate_manifest`: every value of ``index.json`` is checked
  (types, ranges, safe names) before anything uses it, and paths are only ever built from a
  validated generation number (:func:`bm25_dir`, :func:`docstore_file`). A bad value is a
  :class:`DamagedIndexError` naming the file, the key and the value.
* :func:`generation_record` / :func:`verify_generation`: sha256 of each file of a generation
  (BM25 folder, docstore JSON) and the number of indexed chunks, recorded in the manifest at
  commit and checked on open, so a damaged folder is an error instead of wrong answers.
* :func:`fsync_file`, :func:`fsync_dir`, :func:`fsync_tree` (from ``_files``, the durable-write module), :func:`write_json_atomic`:
  durability (POSIX; a no-op where the platform cannot fsync a directory).
* :class:`FileLock` and :class:`WriteGuard`: one writer at a time, across the threads of a
  process (a re-entrant lock) and across processes (``flock`` on ``.write.lock`` in the folder;
  ``msvcrt.locking`` on Windows). A writer waits for the lock up to a timeout, then gets
  :class:`IndexWriteLockedError`.
* :func:`check_build_target`, :func:`publish_new_folder`, :func:`publish_into`,
  :func:`resume_publish`: a build is published into its folder moving only the index's own
  entries (:data:`INDEX_ENTRIES`); the user's files in the folder are never moved or deleted, a
  folder whose files would be replaced is refused, and a publish killed half-way is finished
  by the next open.

Nothing here knows about Qdrant, BM25 or LlamaIndex: only paths, JSON values and bytes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, FrozenSet, Iterator, List, Mapping, Optional, Sequence

from .._files import atomic_writer, fsync_dir, fsync_file, fsync_tree

logger = logging.getLogger(__name__)

MANIFEST = "index.json"
WRITE_LOCK = ".write.lock"
#: In a folder a build is being published into: the build and the entries moving in and out
#: (:func:`publish_into`); deleted once ``index.json`` is in place.
PUBLISH_MARKER = ".index-publish.json"
#: In the build folder: where :func:`publish_into` moves the entries it replaces (deleted with it).
REPLACED_ENTRIES = ".replaced"
#: The top-level entries of an index folder, all written by ``HybridIndex`` (``edge``: the point
#: store; ``qdrant``: the point store of format 1). A build or rebuild only ever moves aside or
#: deletes entries of these names (and :data:`INDEX_SIDE_FILES`); every other entry of the folder
#: is the user's and is never touched.
INDEX_ENTRIES = frozenset({MANIFEST, "edge", "bm25", "docstore", "qdrant", "embeddings.sqlite", WRITE_LOCK, PUBLISH_MARKER})
#: Files made beside them: SQLite's journals of the cache, and the temporary file of an atomic JSON
#: write (:func:`write_json_atomic`: ``tempfile.mkstemp``'s 8 characters).
INDEX_SIDE_FILES = re.compile(r"embeddings\.sqlite-(journal|wal|shm)|(index|\.index-publish)\.json[a-z0-9_]{8}\.tmp")
_MARKER_TEMP = re.compile(r"\.index-publish\.json[a-z0-9_]{8}\.tmp")
_BUILD_ID = re.compile(r"[0-9a-f]{32}")
#: Seconds a writer waits for another process's write to finish before giving up.
DEFAULT_LOCK_TIMEOUT = 60.0
#: Collection names: letters, digits, ``_`` and ``-`` (Qdrant local mode makes a folder of it).
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]{0,127}")
_GEN_DIR = re.compile(r"gen-(0|[1-9][0-9]{0,17})")
_GEN_FILE = re.compile(r"gen-(0|[1-9][0-9]{0,17})\.json")
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_GENERATION = 10**18 - 1  # gen-N names stay short (and match _GEN_DIR)
_HASH_CHUNK = 1 << 20


# ---------------------------------------------------------------------------------- errors


def repair_hint(storage_dir: Path | str) -> str:
    """How to rebuild a damaged folder (CLI and Python)."""
    return (
        f"rebuild it: `rkit index <documents> --storage {storage_dir} --rebuild`, or "
        f"HybridIndex.from_documents(documents, {str(storage_dir)!r}, overwrite=True)"
    )


class DamagedIndexError(ValueError):
    """A file of an index folder is unreadable, inconsistent or changed outside ``HybridIndex``.

    The message names the file and the repair. ``path`` is that file, ``storage_dir`` the folder.
    """

    def __init__(self, path: Path | str, problem: str, storage_dir: Path | str, repair: Optional[str] = None) -> None:
        self.path = path if isinstance(path, str) else Path(path)  # a str names a Qdrant server's collection
        self.storage_dir = Path(storage_dir)
        self.problem = problem
        super().__init__(f"{path}: {problem}. The index folder is damaged; {repair or repair_hint(storage_dir)}")


class IndexWriteLockedError(RuntimeError):
    """Another process kept the folder's write lock longer than the timeout."""

    def __init__(self, lock_path: Path, timeout: Optional[float]) -> None:
        self.lock_path = Path(lock_path)
        waited = f" for more than {timeout:g} s" if timeout else ""
        super().__init__(
            f"another process (or another HybridIndex object) is writing to {lock_path.parent} (it holds "
            f"{lock_path}{waited}): wait for that write or build to finish and try again"
        )


class IndexReadOnlyError(RuntimeError):
    """The index object cannot write (or search Qdrant) until the folder is opened again."""

    def __init__(self, storage_dir: Path | str, reason: str, what_to_do: Optional[str] = None) -> None:
        self.storage_dir = Path(storage_dir)
        self.reason = reason
        what_to_do = what_to_do or (
            "Free disk space (or fix the folder's permissions), then open it again with HybridIndex.load to "
            "finish the roll-back"
        )
        super().__init__(
            f"{storage_dir} is open read-only: {reason}. Queries answer from the committed index "
            "(Qdrant-side search, mode='qdrant_hybrid' or dense_search='qdrant', is unavailable) and writes "
            f"are refused. {what_to_do}"
        )


class RefusingLock:
    """Stands in for a read-write lock in an index that must not touch Qdrant: both sides raise."""

    def __init__(self, error: Exception) -> None:
        self._error = error

    @contextmanager
    def read(self) -> Iterator[None]:
        raise self._error
        yield  # pragma: no cover

    @contextmanager
    def write(self) -> Iterator[None]:
        raise self._error
        yield  # pragma: no cover


# ---------------------------------------------------------------------------------- manifest


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """A finite int or float, not a bool (an int too large for a float is not: JSON can hold one)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


class _Checker:
    """Checks one manifest, raising :class:`DamagedIndexError` with the key path and the value."""

    def __init__(self, path: Path, storage_dir: Path) -> None:
        self.path = path
        self.storage_dir = storage_dir

    def bad(self, key: str, value: Any, expected: str) -> DamagedIndexError:
        return DamagedIndexError(self.path, f"key {key!r} holds {_short(value)}, expected {expected}", self.storage_dir)

    def require(self, data: Mapping[str, Any], key: str, prefix: str = "") -> Any:
        if key not in data:
            raise DamagedIndexError(self.path, f"key {prefix + key!r} is missing", self.storage_dir)
        return data[key]

    def int_(self, value: Any, key: str, minimum: int, maximum: Optional[int] = None) -> int:
        if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
            raise self.bad(key, value, f"an integer >= {minimum}" + (f" and <= {maximum}" if maximum is not None else ""))
        return value

    def number(self, value: Any, key: str, low: float, high: float = math.inf, low_open: bool = False) -> float:
        ok = _is_number(value) and (value > low if low_open else value >= low) and value <= high
        if not ok:
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            if high != math.inf:
                bound += f" and <= {high:g}"
            raise self.bad(key, value, f"a finite number {bound}")
        return float(value)

    def str_(self, value: Any, key: str, optional: bool = False, non_empty: bool = False) -> Optional[str]:
        if value is None and optional:
            return None
        if not isinstance(value, str) or (non_empty and not value):
            raise self.bad(key, value, ("a non-empty string" if non_empty else "a string") + (" or null" if optional else ""))
        return value

    def dict_(self, value: Any, key: str) -> Dict[str, Any]:
        if not isinstance(value, dict):
            raise self.bad(key, value, "a JSON object")
        return value


def check_generation(value: Any) -> int:
    """``value`` if it is a generation number (an int >= 0, not a bool); else a ValueError."""
    if not _is_int(value) or value < 0 or value > MAX_GENERATION:
        raise ValueError(f"a generation is an integer from 0 to {MAX_GENERATION}, got {_short(value)}")
    return value


def validate_manifest(config: Any, path: Path | str, format_version: int | Sequence[int], storage_dir: Optional[Path | str] = None) -> Dict[str, Any]:
    """``config`` (the parsed ``index.json``) after checking every value ``HybridIndex`` uses.

    A format version other than ``format_version`` (one, or a sequence of readable ones) is a ``ValueError`` (a newer or older
    layout); anything else wrong (a missing key, a wrong type, an out-of-range number, an unsafe
    collection name, a journal that does not follow the committed generation) is a
    :class:`DamagedIndexError` naming ``path``, the key and the value. Unknown keys are kept.
    """
    path = Path(path)
    storage = Path(storage_dir) if storage_dir is not None else path.parent
    check = _Checker(path, storage)
    if not isinstance(config, dict):
        raise DamagedIndexError(path, f"holds {_short(config)}, not a JSON object", storage)
    version = config.get("format_version")
    readable = (format_version,) if isinstance(format_version, int) else tuple(format_version)
    if not _is_int(version) or version not in readable:
        shown = readable[0] if len(readable) == 1 else " or ".join(str(v) for v in readable)
        raise ValueError(f"{path}: format_version {version!r}; this version reads {shown}")

    gen = check.int_(check.require(config, "generation"), "generation", 0, MAX_GENERATION - 1)
    check.str_(check.require(config, "embed_model"), "embed_model", non_empty=True)
    if "embed_model_class" in config:
        check.str_(config["embed_model_class"], "embed_model_class", optional=True)
    if config.get("embed_settings") is not None:
        check.dict_(config["embed_settings"], "embed_settings")
    dim = check.require(config, "embed_dim")
    if dim is not None:
        check.int_(dim, "embed_dim", 1)
    parser = check.dict_(check.require(config, "node_parser"), "node_parser")
    check.str_(check.require(parser, "class_name", "node_parser."), "node_parser.class_name", non_empty=True)
    bm25 = check.dict_(check.require(config, "bm25"), "bm25")
    check.number(check.require(bm25, "k1", "bm25."), "bm25.k1", 0.0)
    check.number(check.require(bm25, "b", "bm25."), "bm25.b", 0.0, 1.0)
    check.str_(check.require(bm25, "method", "bm25."), "bm25.method", non_empty=True)
    avgdl = check.require(bm25, "avgdl", "bm25.")
    if avgdl is not None:
        check.number(avgdl, "bm25.avgdl", 0.0, low_open=True)
    check.dict_(check.require(config, "bm25_tokenizer"), "bm25_tokenizer")
    check.str_(check.require(config, "qdrant_url"), "qdrant_url", optional=True)
    collection = check.require(config, "collection")
    if not isinstance(collection, str) or not SAFE_NAME.fullmatch(collection):
        raise check.bad("collection", collection, "a name of letters, digits, '_' and '-' (at most 128)")
    check.int_(check.require(config, "embed_batch_size"), "embed_batch_size", 1)
    build_id = config.get("build_id")
    if build_id is not None and (not isinstance(build_id, str) or not _BUILD_ID.fullmatch(build_id)):
        raise check.bad("build_id", build_id, "null or 32 lower-case hex digits")

    pending = check.require(config, "pending")
    if pending is not None:
        check.dict_(pending, "pending")
        nxt = check.require(pending, "generation", "pending.")
        if not _is_int(nxt) or nxt != gen + 1:
            raise check.bad("pending.generation", nxt, f"{gen + 1} (the committed generation {gen} + 1)")
        touched = check.require(pending, "touched_ids", "pending.")
        if not isinstance(touched, list) or not all(isinstance(i, str) for i in touched):
            raise check.bad("pending.touched_ids", touched, "a list of node id strings")

    record = config.get("integrity")
    if record is not None:
        check.dict_(record, "integrity")
        rgen = check.require(record, "generation", "integrity.")
        if not _is_int(rgen) or rgen != gen:
            raise check.bad("integrity.generation", rgen, f"{gen} (the committed generation)")
        files = check.dict_(check.require(record, "files", "integrity."), "integrity.files")
        for name, digest in files.items():
            if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
                raise check.bad(f"integrity.files[{name!r}]", digest, "a sha256 hex digest")
        check.int_(check.require(record, "chunks", "integrity."), "integrity.chunks", 0)
    return config


def read_manifest(path: Path | str, format_version: int | Sequence[int], storage_dir: Optional[Path | str] = None) -> Dict[str, Any]:
    """Parse and validate ``index.json`` (see :func:`validate_manifest`)."""
    path = Path(path)
    storage = Path(storage_dir) if storage_dir is not None else path.parent
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DamagedIndexError(path, f"is not valid JSON ({exc})", storage) from None
    return validate_manifest(config, path, format_version, storage)


# ---------------------------------------------------------------------------------- layout


def bm25_dir(storage_dir: Path, generation: Any) -> Path:
    """``storage_dir/bm25/gen-N`` for a validated generation number."""
    return Path(storage_dir) / "bm25" / f"gen-{check_generation(generation)}"


def docstore_file(storage_dir: Path, generation: Any) -> Path:
    """``storage_dir/docstore/gen-N.json`` for a validated generation number."""
    return Path(storage_dir) / "docstore" / f"gen-{check_generation(generation)}.json"


def generation_paths(storage_dir: Path) -> Dict[int, List[Path]]:
    """Every generation's files and folders found in ``storage_dir`` (by listing, never by name)."""
    found: Dict[int, List[Path]] = {}
    storage_dir = Path(storage_dir)
    for folder, pattern in ((storage_dir / "bm25", _GEN_DIR), (storage_dir / "docstore", _GEN_FILE)):
        if not folder.is_dir():
            continue
        for entry in folder.iterdir():
            match = pattern.fullmatch(entry.name)
            if match:
                found.setdefault(int(match.group(1)), []).append(entry)
    return found


def remove_path(path: Path) -> None:
    """Delete a file or a folder (not following symlinks); missing is fine."""
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def building_dir(storage_dir: Path | str) -> Path:
    """The sibling folder a new index is built in before it is moved to ``storage_dir``."""
    storage_dir = Path(storage_dir)
    return storage_dir.parent / f".{storage_dir.name}.building"


def replaced_dir(storage_dir: Path | str) -> Path:
    """The sibling folder earlier versions moved a replaced index folder to (the whole folder, the
    user's files too). This version never makes it, and never deletes one it finds."""
    storage_dir = Path(storage_dir)
    return storage_dir.parent / f".{storage_dir.name}.replaced"


def is_index_entry(name: str) -> bool:
    """Whether a top-level entry called ``name`` is part of an index folder's layout
    (:data:`INDEX_ENTRIES`, :data:`INDEX_SIDE_FILES`)."""
    return name in INDEX_ENTRIES or INDEX_SIDE_FILES.fullmatch(name) is not None


def _lexists(path: Path) -> bool:
    return os.path.lexists(path)


def _movable_entries(folder: Path) -> List[str]:
    """The index entries of ``folder`` a publish moves aside (all but the write lock, which stays
    the folder's lock, and the publish marker), ``index.json`` first."""
    names = [e.name for e in folder.iterdir() if is_index_entry(e.name) and e.name not in (WRITE_LOCK, PUBLISH_MARKER)]
    return sorted(names, key=lambda name: (name != MANIFEST, name))


def read_publish_marker(folder: Path | str) -> Optional[Dict[str, Any]]:
    """The marker of a publish into ``folder`` (:func:`publish_into`): ``{"build_id", "moving_in",
    "replacing"}``; None when there is none or the file is not one (then it is the user's)."""
    try:
        data = json.loads((Path(folder) / PUBLISH_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("build_id"), str):
        return None
    for key in ("moving_in", "replacing"):
        names = data.get(key)
        if not isinstance(names, list) or not all(isinstance(n, str) and is_index_entry(n) for n in names):
            return None
    return data


def publish_leftovers(folder: Path | str) -> FrozenSet[str]:
    """Entries of ``folder`` an interrupted publish left (the ones its marker names as moving in or
    out), when the folder holds no ``index.json``; empty otherwise."""
    folder = Path(folder)
    if (folder / MANIFEST).exists():
        return frozenset()
    marker = read_publish_marker(folder)
    if marker is None:
        return frozenset()
    return frozenset(marker["moving_in"]) | frozenset(marker["replacing"])


def clashing_entries(folder: Path | str) -> List[str]:
    """Entries of a folder that holds no index whose names an index there would take: the user's
    (neither the write lock, only ever locked, nor what an interrupted publish left). Empty for a
    missing folder and an index folder."""
    folder = Path(folder)
    if not folder.is_dir() or (folder / MANIFEST).exists():
        return []
    ours = publish_leftovers(folder)
    marker = read_publish_marker(folder)
    clashes = []
    for entry in folder.iterdir():
        name = entry.name
        if name == WRITE_LOCK or _MARKER_TEMP.fullmatch(name) or (name == PUBLISH_MARKER and marker is not None):
            continue
        if is_index_entry(name) and name not in ours:
            clashes.append(name + ("/" if entry.is_dir() and not entry.is_symlink() else ""))
    return sorted(clashes)


def check_build_target(target: Path | str, overwrite: bool) -> None:
    """Refuse to build an index into ``target`` (a ValueError saying what to do) when it already
    holds one and not ``overwrite``, is a file, or holds entries of the user's that an index there
    would replace (:func:`clashing_entries`)."""
    target = Path(target)
    if (target / MANIFEST).exists():
        if not overwrite:
            raise ValueError(
                f"{target} already holds an index; open it with HybridIndex.load({str(target)!r}) and "
                "upsert(), or pass overwrite=True to rebuild it"
            )
        return
    if target.exists() and not target.is_dir():
        raise ValueError(f"{target} is a file, not a folder: choose another storage_dir")
    clashes = clashing_entries(target)
    if clashes:
        them = "them" if len(clashes) > 1 else "it"
        raise ValueError(
            f"{target} holds no index ({MANIFEST}) but holds {', '.join(clashes)}, which an index there would "
            f"replace: move {them} out of the folder, or build the index in another storage_dir"
        )


def clear_build_folder(build: Path, keep_prefix: str) -> bool:
    """Delete the index entries of ``build`` (and what an interrupted publish moved aside there)
    but the write lock and the files whose name starts with ``keep_prefix``; returns whether any
    of those were kept. An entry of another name is a ValueError: the folder is not a build of ours."""
    build = Path(build)
    strays = sorted(e.name for e in build.iterdir() if not is_index_entry(e.name) and e.name != REPLACED_ENTRIES)
    if strays:
        raise ValueError(
            f"{build} is where this package builds an index, but it holds {', '.join(strays)}, which it did not "
            f"put there: move {'them' if len(strays) > 1 else 'it'} elsewhere and build again"
        )
    kept = False
    for entry in build.iterdir():
        if entry.name == WRITE_LOCK:
            continue
        if entry.name.startswith(keep_prefix) and entry.is_file() and not entry.is_symlink():
            kept = kept or entry.name == keep_prefix
            continue
        remove_path(entry)
    return kept


def publish_new_folder(build: Path, target: Path) -> bool:
    """Publish the complete folder ``build`` as ``target`` in one rename when ``target`` does not
    exist; False (nothing done) when it does: then :func:`publish_into`."""
    build, target = Path(build), Path(target)
    if _lexists(target):
        return False
    try:
        os.rename(build, target)
    except OSError:
        if _lexists(target):  # made meanwhile
            return False
        raise
    fsync_dir(target.parent)
    return True


def publish_into(build: Path, target: Path, build_id: str) -> None:
    """Move the complete index in ``build`` into the existing folder ``target``, moving only index
    entries (:func:`is_index_entry`): the user's entries of ``target`` stay where they are.

    The caller holds ``target``'s write lock and checked it (:func:`check_build_target`). Each
    step is durable before the next:

    1. ``target/.index-publish.json`` names the build and the entries moving in and out;
    2. ``target``'s index entries move to ``build/.replaced``, ``index.json`` first: the folder
       stops being the old index before any of its files go;
    3. ``build``'s entries move in, ``index.json`` last: the folder is an index again only once
       the new one is complete;
    4. the marker, then ``build`` with the replaced entries, are deleted.

    Killed before 2, ``target`` holds the old index; after 3, the new one; in between, the new index
    is complete across ``build`` and ``target`` (the old one across ``build/.replaced`` and
    ``target``) and :func:`resume_publish` (``HybridIndex.load``) finishes the move. A step that
    fails with an error is undone: ``target`` holds the old index again.
    """
    build, target = Path(build), Path(target)
    moving_in = sorted(e.name for e in build.iterdir() if e.name not in (MANIFEST, WRITE_LOCK, REPLACED_ENTRIES))
    strays = [name for name in moving_in if not is_index_entry(name)]
    if strays or not (build / MANIFEST).is_file():
        raise ValueError(f"{build} is not a complete index build (entries {strays}, {MANIFEST} present: {(build / MANIFEST).is_file()})")
    old_format_leftover = replaced_dir(target)
    if _lexists(old_format_leftover):
        logger.warning(
            "%s was left by an interrupted rebuild of an earlier version and may hold files of yours: it is left "
            "alone; check it and delete it",
            old_format_leftover,
        )
    write_json_atomic(target / PUBLISH_MARKER, {"build_id": build_id, "moving_in": moving_in, "replacing": _movable_entries(target)})
    try:
        _move_build_in(build, target, moving_in)
    except BaseException:
        try:
            _undo_publish(build, target, moving_in)
        except Exception:  # pragma: no cover - resume_publish finishes it on the next open
            logger.exception("%s: could not undo the failed publish; HybridIndex.load finishes it", target)
        raise
    _finish_publish(build, target)


def _move_build_in(build: Path, target: Path, moving_in: Sequence[str]) -> None:
    """Steps 2 and 3 of :func:`publish_into`, resumable: an entry named as moving in that is no
    longer in ``build`` has moved in already, and stays."""
    if not (build / MANIFEST).exists():
        return  # the new index.json is in place: nothing left to move
    trash = build / REPLACED_ENTRIES
    trash.mkdir(exist_ok=True)
    for name in _movable_entries(target):
        if name in moving_in and not _lexists(build / name):
            continue
        if _lexists(trash / name):
            remove_path(trash / name)
        os.rename(target / name, trash / name)
    fsync_dir(trash)
    fsync_dir(target)
    for name in moving_in:
        if _lexists(build / name):
            os.rename(build / name, target / name)
    fsync_dir(target)
    os.rename(build / MANIFEST, target / MANIFEST)
    fsync_dir(target)


def _undo_publish(build: Path, target: Path, moving_in: Sequence[str]) -> None:
    """Put the old index back after a failed step 2 or 3 (nothing to undo once the new
    ``index.json`` is in place)."""
    if not (build / MANIFEST).exists():
        return
    for name in moving_in:
        if not _lexists(build / name) and _lexists(target / name):
            os.rename(target / name, build / name)
    trash = build / REPLACED_ENTRIES
    if trash.is_dir():
        for name in sorted((e.name for e in trash.iterdir()), key=lambda name: (name == MANIFEST, name)):
            if not _lexists(target / name):
                os.rename(trash / name, target / name)
    fsync_dir(target)
    (target / PUBLISH_MARKER).unlink(missing_ok=True)
    fsync_dir(target)


def _finish_publish(build: Path, target: Path) -> None:
    """Step 4 of :func:`publish_into`: the marker, then the build folder with the replaced entries."""
    (target / PUBLISH_MARKER).unlink(missing_ok=True)
    fsync_dir(target)
    remove_path(build)
    fsync_dir(build.parent)


def resume_publish(target: Path | str) -> bool:
    """Finish a publish into ``target`` that was killed between its steps 2 and 3
    (:func:`publish_into`); True when it did.

    Only when ``target`` holds no ``index.json`` but a publish marker, the build folder beside it
    holds the complete build the marker names, and neither folder's write lock is held (else a
    publish is running: False).
    """
    target = Path(target).resolve()
    if (target / MANIFEST).exists():
        return False
    marker = read_publish_marker(target)
    build = building_dir(target)
    if marker is None or not (build / MANIFEST).is_file():
        return False
    try:
        built = json.loads((build / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(built, dict) or built.get("build_id") != marker["build_id"]:
        return False
    locks = [FileLock(build / WRITE_LOCK), FileLock(target / WRITE_LOCK)]
    try:
        for lock in locks:
            lock.acquire(timeout=0)
        _move_build_in(build, target, marker["moving_in"])
        _finish_publish(build, target)
    except IndexWriteLockedError:
        return False
    finally:
        for lock in reversed(locks):
            lock.release()
    logger.warning("%s: finished publishing build %s, which was interrupted", target, marker["build_id"])
    return True


# ---------------------------------------------------------------------------------- checksums


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(_HASH_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def generation_files(storage_dir: Path, generation: int) -> Dict[str, Path]:
    """The files of one generation, by path relative to ``storage_dir`` (``/``-separated)."""
    storage_dir = Path(storage_dir)
    out: Dict[str, Path] = {}
    folder = bm25_dir(storage_dir, generation)
    if folder.is_dir():
        for root, dirs, files in os.walk(folder):
            dirs.sort()
            for name in sorted(files):
                path = Path(root) / name
                out[path.relative_to(storage_dir).as_posix()] = path
    doc = docstore_file(storage_dir, generation)
    if doc.is_file():
        out[doc.relative_to(storage_dir).as_posix()] = doc
    return out


def generation_record(storage_dir: Path, generation: int, chunks: int) -> Dict[str, Any]:
    """What :func:`verify_generation` checks later: each file's sha256 and the number of chunks
    (leaf nodes: BM25 documents and Qdrant points)."""
    files = {name: sha256_file(path) for name, path in generation_files(storage_dir, generation).items()}
    return {"generation": check_generation(generation), "files": files, "chunks": int(chunks)}


def verify_generation(storage_dir: Path, generation: int, record: Optional[Mapping[str, Any]], manifest: Path) -> bool:
    """Check the files of ``generation`` against the manifest's record (:func:`generation_record`).

    Returns False when there is no record (a folder written before checksums: unverified), True
    when every recorded file is present and unchanged; otherwise raises :class:`DamagedIndexError`
    naming the file. The recorded names are only compared, never opened.
    """
    storage_dir = Path(storage_dir)
    expected = [bm25_dir(storage_dir, generation), docstore_file(storage_dir, generation)]
    missing = [p for p in expected if not p.exists()]
    if missing:
        raise DamagedIndexError(
            missing[0], f"is missing (generation {generation} is the one {manifest.name} commits)", storage_dir
        )
    if record is None:
        return False
    actual = generation_files(storage_dir, generation)
    for name, digest in sorted(record["files"].items()):
        path = actual.get(name)
        if path is None:
            raise DamagedIndexError(storage_dir / name, "is missing", storage_dir)
        if sha256_file(path) != digest:
            raise DamagedIndexError(path, f"changed since generation {generation} was written (sha256 differs)", storage_dir)
    return True


# ---------------------------------------------------------------------------------- durability


def write_json_atomic(path: Path | str, data: Any) -> None:
    """Replace ``path`` with ``data`` as JSON in one rename: the file and its directory entry are
    fsynced, and a failed write leaves the old file and no temporary file
    (:func:`~llama_index_retrieval_kit._files.atomic_writer`; temporary names
    ``<name><8 characters>.tmp``, :data:`INDEX_SIDE_FILES`; owner-only permissions)."""
    path = Path(path)
    with atomic_writer(path, temp_prefix=path.name, file_mode=0o600, make_parents=False, sync_folder=False) as fh:
        json.dump(data, fh, indent=2)
    fsync_dir(path.parent)


# ---------------------------------------------------------------------------------- locks

try:  # POSIX
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - Windows
    _fcntl = None  # type: ignore[assignment]
try:  # Windows
    import msvcrt as _msvcrt  # type: ignore[import-not-found]
except ImportError:
    _msvcrt = None  # type: ignore[assignment]

_warned_no_locking = False


class FileLock:
    """An exclusive lock on a file, between processes (and between open handles of one process).

    ``fcntl.flock`` on POSIX, ``msvcrt.locking`` on Windows; elsewhere a warning, once, that other
    processes are not excluded. The lock is released when the holder closes it or exits.
    """

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._fh: Any = None

    @property
    def held(self) -> bool:
        return self._fh is not None

    def acquire(self, timeout: Optional[float] = DEFAULT_LOCK_TIMEOUT) -> None:
        """Take the lock, waiting up to ``timeout`` seconds (None: forever; 0: one try);
        :class:`IndexWriteLockedError` when it stays taken."""
        if self._fh is not None:
            raise RuntimeError(f"{self.path} is already locked by this FileLock")
        # O_NOFOLLOW: a lock file planted as a symlink must not make us create files elsewhere.
        fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        fh = os.fdopen(fd, "r+b")
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = 0.01
        try:
            while not self._try(fh):
                if deadline is not None and time.monotonic() >= deadline:
                    raise IndexWriteLockedError(self.path, timeout)
                time.sleep(delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic())))
                delay = min(delay * 2, 0.25)
        except BaseException:
            fh.close()
            raise
        self._fh = fh

    def _try(self, fh: Any) -> bool:
        global _warned_no_locking
        if _fcntl is not None:
            try:
                _fcntl.flock(fh.fileno(), _fcntl.LOCK_EX | _fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False
        if _msvcrt is not None:  # pragma: no cover - Windows
            try:
                fh.seek(0)
                _msvcrt.locking(fh.fileno(), _msvcrt.LK_NBLCK, 1)
                return True
            except OSError:
                return False
        if not _warned_no_locking:  # pragma: no cover
            _warned_no_locking = True
            logger.warning("no file locking on this platform: writers in other processes are not excluded")
        return True

    def release(self) -> None:
        fh, self._fh = self._fh, None
        if fh is None:
            return
        try:
            if _fcntl is not None:
                _fcntl.flock(fh.fileno(), _fcntl.LOCK_UN)
            elif _msvcrt is not None:  # pragma: no cover - Windows
                fh.seek(0)
                _msvcrt.locking(fh.fileno(), _msvcrt.LK_UNLCK, 1)
        finally:
            fh.close()


class WriteGuard:
    """One writer at a time on a storage folder: a re-entrant lock for the threads of this
    process, and the folder's :class:`FileLock` for other processes (taken by the outermost
    :meth:`hold` and released with it). Threads wait for each other without a limit; another
    process's write is waited for up to ``timeout`` seconds (None: :data:`DEFAULT_LOCK_TIMEOUT`
    as it is when the lock is taken; ``math.inf``: no limit; 0: no wait), then
    :class:`IndexWriteLockedError`."""

    def __init__(self, lock_path: Path | str, timeout: Optional[float] = None) -> None:
        self.timeout = timeout
        self._thread_lock = threading.RLock()
        self._file_lock = FileLock(lock_path)
        self._depth = 0

    @property
    def lock_path(self) -> Path:
        return self._file_lock.path

    def retarget(self, lock_path: Path | str) -> None:
        """Use another lock file (the folder moved); only while no one holds the guard."""
        with self._thread_lock:
            if self._depth:
                raise RuntimeError("cannot move a held write guard")
            self._file_lock = FileLock(lock_path)

    @contextmanager
    def hold(self, timeout: Optional[float] = None) -> Iterator[None]:
        """Hold both locks for the ``with`` block (re-entrant in the same thread); ``timeout``
        overrides the guard's own for this call."""
        with self._thread_lock:
            if self._depth == 0:
                timeout = timeout if timeout is not None else self.timeout
                timeout = DEFAULT_LOCK_TIMEOUT if timeout is None else timeout
                self._file_lock.acquire(None if timeout == math.inf else timeout)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._file_lock.release()

    @contextmanager
    def hold_local(self) -> Iterator[None]:
        """Hold the in-process lock only (wait for this process's writers, e.g. before closing)."""
        with self._thread_lock:
            yield


# ---------------------------------------------------------------------------------- bulk work

_gc_lock = threading.Lock()
_gc_pauses = 0
_gc_resume = False


@contextmanager
def paused_gc() -> Iterator[None]:
    """Run a bulk index read or write with Python's cyclic garbage collector paused.

    A write of N chunks allocates millions of small containers (nodes, payloads, JSON) that
    stay alive, and each allocation burst triggers collections that walk every tracked object:
    measured, 17% of the CPU of a 20,000-chunk build, growing with the heap. Reference counting
    still frees everything without cycles; cycles made meanwhile are collected once the last
    pause ends (re-entrant and thread-safe: the collector is enabled again only if it was enabled
    when the first pause began).
    """
    global _gc_pauses, _gc_resume
    import gc

    with _gc_lock:
        if _gc_pauses == 0:
            _gc_resume = gc.isenabled()
            gc.disable()
        _gc_pauses += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_pauses -= 1
            if _gc_pauses == 0 and _gc_resume:
                gc.enable()
