"""Writing user-visible files safely: a file is replaced whole or not at all.

:func:`atomic_writer` writes into a new temporary file next to the target (``tempfile.mkstemp``:
a fresh name, never a fixed ``<name>.tmp`` that another process or a planted symlink could
share), flushes and fsyncs it, then renames it over the target in one step (``os.replace``: a
symlink at the target is replaced, not followed) and fsyncs the folder. A failure or a crash
part-way leaves the earlier file as it was and no temporary file behind (a crash may leave one,
named ``.<name>.*.tmp``). The new file keeps the mode of the one it replaces (0o644 for a new one).

:func:`folder_lock` serialises the writers of one folder (and keeps readers out while one writes),
between the threads of a process and between processes, without adding a file to the folder. It
waits for the holders up to a timeout (60 s by default), then raises :class:`FolderLockTimeout`:
a holder stopped half-way (SIGSTOP, a debugger) is reported instead of hanging every other one.
"""

from __future__ import annotations

import logging
import os
import stat
import tempfile
import threading
import time
import weakref
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import IO, Any, Callable, Hashable, Iterator, List, Optional

from .indices.rwlock import ReadWriteLock

try:  # POSIX
    import fcntl as _fcntl
except ImportError:  # pragma: no cover - Windows
    _fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

NEW_FILE_MODE = 0o644
#: How long :func:`folder_lock` waits for a folder's holders by default (seconds).
FOLDER_LOCK_TIMEOUT_S = 60.0
#: First and longest pause between two tries of another process's lock (seconds; doubling).
FLOCK_FIRST_DELAY_S = 0.001
FLOCK_MAX_DELAY_S = 0.05


def fsync_dir(path: Path | str) -> None:
    """Flush a directory's entries (after a create, rename or delete in it); a no-op where the
    platform cannot open directories (Windows) or fsync them."""
    if os.name == "nt":
        return
    try:
        fd = os.open(str(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:  # EINVAL/ENOTSUP on file systems that do not support it
        logger.debug("fsync of directory %s: %s", path, exc)
    finally:
        os.close(fd)


def fsync_file(path: Path | str) -> None:
    """Flush a file's data to disk."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path | str) -> None:
    """fsync every file under ``path`` (or ``path`` itself), then the folders, deepest first."""
    path = Path(path)
    if path.is_file():
        fsync_file(path)
        fsync_dir(path.parent)
        return
    folders: List[str] = []
    for root, _dirs, files in os.walk(path):
        folders.append(root)
        for name in files:
            fsync_file(os.path.join(root, name))
    for root in reversed(folders):
        fsync_dir(root)
    fsync_dir(path.parent)


@contextmanager
def atomic_writer(
    path: Path | str,
    mode: str = "w",
    encoding: str | None = "utf-8",
    newline: str | None = None,
    temp_prefix: str | None = None,
    file_mode: int | None = None,
    make_parents: bool = True,
    sync_folder: bool = True,
) -> Iterator[IO[Any]]:
    """A file handle whose content replaces ``path`` when the ``with`` block ends without error
    (``mode`` ``"w"`` for text, ``"wb"`` for bytes; ``newline`` as :func:`open`'s, text only).

    ``temp_prefix``: the temporary file's name prefix (default ``.<name>.``); ``file_mode``: the
    new file's permissions (default: those of the file it replaces, else :data:`NEW_FILE_MODE`);
    ``make_parents=False``: a missing folder is an error instead of being created;
    ``sync_folder=False``: the caller makes the rename durable (:func:`fsync_dir` of the folder)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    if file_mode is None:
        try:
            file_mode = stat.S_IMODE(os.stat(path).st_mode)  # follows a symlink: the mode of what it names
        except OSError:
            file_mode = NEW_FILE_MODE
    prefix = f".{path.name}." if temp_prefix is None else temp_prefix
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=".tmp")
    try:
        os.chmod(tmp, file_mode)
        text = mode == "w"
        with os.fdopen(fd, mode, encoding=encoding if text else None, newline=newline if text else None) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync_folder:
        fsync_dir(path.parent)


def check_replaceable(path: Path | str, is_ours: Callable[[Path], bool], what: str, force: str, overwrite: bool = False) -> None:
    """Refuse (a one-line ValueError) to replace ``path`` when it exists, is not empty and
    ``is_ours(path)`` does not recognise it as ``what`` (the writer's own kind of file, e.g.
    "a saved no-answer gate"): someone's dataset, document or notes would be lost. ``force`` names
    the option that replaces it anyway (e.g. "overwrite=True (rkit calibrate --overwrite)"), given
    here as ``overwrite``. A folder is refused either way."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_dir():
        raise ValueError(f"{path} is a folder: give the path of a file")
    if overwrite or (path.is_file() and path.stat().st_size == 0) or is_ours(path):
        return
    raise ValueError(f"{path} exists and is not {what}: writing there would replace it. Choose another path, or pass {force}")


def write_text_atomic(path: Path | str, text: str, encoding: str = "utf-8") -> Path:
    """Replace ``path`` with ``text`` whole (:func:`atomic_writer`)."""
    with atomic_writer(path, "w", encoding) as fh:
        fh.write(text)
    return Path(path)


def write_bytes_atomic(path: Path | str, data: bytes) -> Path:
    """Replace ``path`` with ``data`` whole (:func:`atomic_writer`)."""
    with atomic_writer(path, "wb", None) as fh:
        fh.write(data)
    return Path(path)


# ---------------------------------------------------------------------------------- folder locks

class FolderLockTimeout(RuntimeError):
    """A folder stayed locked by another process or thread for longer than ``folder_lock``'s timeout.

    Not an ``OSError`` (as the built-in ``TimeoutError`` is): code that reads a failed file read as a
    damaged folder must not read a busy one so."""

    def __init__(self, folder: Path | str, waited_s: float, shared: bool) -> None:
        self.folder = Path(folder)
        self.waited_s = waited_s
        self.shared = shared
        holders = "writing to it" if shared else "writing to it or reading it"
        super().__init__(
            f"{self.folder} is locked: another process or thread is {holders} (waited {waited_s:g} s for its lock). "
            "Wait for it to finish and try again; if that process is stopped (SIGSTOP, a debugger), resume it or end it"
        )

    def __reduce__(self) -> Any:  # pickled with its own arguments (an exception's default is the message)
        return (type(self), (self.folder, self.waited_s, self.shared))


_folder_locks: "weakref.WeakValueDictionary[Hashable, ReadWriteLock]" = weakref.WeakValueDictionary()
_folder_locks_guard = threading.Lock()
_warned_unlockable = False


def _thread_lock(key: Hashable) -> ReadWriteLock:
    """This process's readers-writer lock of one folder (kept while someone holds it)."""
    with _folder_locks_guard:
        lock = _folder_locks.get(key)
        if lock is None:
            lock = _folder_locks[key] = ReadWriteLock()
        return lock


def _open_folder(path: Path) -> Optional[int]:
    """A read-only descriptor of the folder ``path`` (what ``flock`` locks), or None where it
    cannot be opened (missing, not a folder, no permission, Windows)."""
    if _fcntl is None:
        return None
    try:
        return os.open(str(path), os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return None


def _poll_flock(fd: int, mode: int, deadline: Optional[float]) -> bool:
    """``flock(fd, mode)``: waiting for other holders until ``deadline`` (``time.monotonic``; None:
    forever), trying again after pauses doubling from :data:`FLOCK_FIRST_DELAY_S` to
    :data:`FLOCK_MAX_DELAY_S`. False when still held by another at the deadline."""
    if deadline is None:
        _fcntl.flock(fd, mode)
        return True
    delay = FLOCK_FIRST_DELAY_S
    while True:
        try:
            _fcntl.flock(fd, mode | _fcntl.LOCK_NB)
            return True
        except BlockingIOError:  # another holder
            pass
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        time.sleep(min(delay, remaining))
        delay = min(delay * 2, FLOCK_MAX_DELAY_S)


def _flock(fd: Optional[int], shared: bool, path: Path, timeout_s: Optional[float], deadline: Optional[float]) -> bool:
    """``flock`` the folder descriptor ``fd``, waiting for other holders until ``deadline`` (then
    :class:`FolderLockTimeout` saying ``timeout_s``); False when the file system refuses (warned
    once: other processes are then not excluded)."""
    global _warned_unlockable
    if _fcntl is None and not shared and not _warned_unlockable:  # pragma: no cover - Windows
        _warned_unlockable = True
        logger.warning("folders cannot be locked on this platform: writers in other processes are not excluded")
    if fd is None or _fcntl is None:
        return False
    try:
        locked = _poll_flock(fd, _fcntl.LOCK_SH if shared else _fcntl.LOCK_EX, deadline)
    except OSError as exc:  # e.g. EBADF/ENOLCK on NFS, which emulates flock with byte-range locks
        if not _warned_unlockable:
            _warned_unlockable = True
            logger.warning("cannot lock folder %s (%s): writers in other processes are not excluded", path, exc)
        return False
    if not locked:
        raise FolderLockTimeout(path, float(timeout_s or 0.0), shared)
    return True


def _check_timeout(timeout_s: Optional[float]) -> None:
    """A ValueError naming ``timeout_s`` unless it is None or a number of seconds >= 0."""
    if timeout_s is None:
        return
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s >= 0:
        raise ValueError(f"timeout_s must be None (wait forever) or a number of seconds >= 0, got {timeout_s!r}")


@contextmanager
def folder_lock(folder: Path | str, shared: bool = False, timeout_s: Optional[float] = FOLDER_LOCK_TIMEOUT_S) -> Iterator[bool]:
    """Hold the lock of ``folder`` for the ``with`` block: exclusive (``shared=False``, a writer:
    alone) or shared (readers: together, while no writer holds it). Waits for the holders up to
    ``timeout_s`` seconds in all (None: forever; 0: no wait), then raises
    :class:`FolderLockTimeout` (a holder may be stopped: SIGSTOP, a debugger).

    Between the threads of this process a readers-writer lock per folder; between processes
    ``flock`` on the folder itself (no lock file: the folder's content stays what its writer put
    there, and a read-only folder is locked too). Advisory: only holders of this lock are
    excluded. Yields whether other processes are excluded: False when the folder cannot be opened
    (missing: nothing to lock) or locked (Windows, which cannot lock a folder; a file system
    without ``flock``); the threads of this process still are. Release happens when the block
    ends (and, for other processes, when this one exits)."""
    _check_timeout(timeout_s)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    path = Path(folder)
    fd = _open_folder(path)
    try:
        lock = _thread_lock(_folder_key(path, fd))
        with ExitStack() as this_process:
            try:
                this_process.enter_context(lock.read(timeout_s) if shared else lock.write(timeout_s))
            except TimeoutError:
                raise FolderLockTimeout(path, float(timeout_s or 0.0), shared) from None
            try:
                yield _flock(fd, shared, path, timeout_s, deadline)
            finally:  # the other processes' turn (closing the descriptor releases its flock) before this one's threads'
                if fd is not None:
                    os.close(fd)
                    fd = None
    finally:
        if fd is not None:
            os.close(fd)


def _folder_key(path: Path, fd: Optional[int]) -> Hashable:
    """What names a folder in this process: its device and inode when open, else its absolute path."""
    if fd is not None:
        info = os.fstat(fd)
        return (info.st_dev, info.st_ino)
    return os.path.normcase(os.path.abspath(path))
