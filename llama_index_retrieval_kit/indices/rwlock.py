"""A small readers-writer lock: many readers at once, a writer alone (writers preferred).

``HybridIndex`` holds the write side while an update changes Qdrant, BM25 and the docstore, and
the queries that read Qdrant directly hold the read side, so a query sees the index before or
after an update, never a mix (Qdrant points are overwritten in place, BM25 swaps snapshots).
Both sides take an optional ``timeout`` (seconds; None: wait forever), past which they raise
:class:`TimeoutError` (``_files.folder_lock`` uses it to give up on a folder held too long).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Optional


class ReadWriteLock:
    """Readers share the lock; a writer waits for running readers and blocks new ones.

    Re-entrant for the writer thread (a write that reads, e.g. a roll-back, does not deadlock);
    a reader must not ask for the write side.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer: int | None = None  # thread id holding the write side
        self._write_depth = 0
        self._waiting_writers = 0

    def _wait_while(self, blocked: Callable[[], bool], timeout: Optional[float], side: str) -> None:
        """With the condition held: wait while ``blocked()``, at most ``timeout`` seconds (None:
        forever; 0: no wait), then :class:`TimeoutError` naming the ``side`` asked for."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while blocked():
            if deadline is None:
                self._cond.wait()
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                held_by = "a writer holds it or waits for it" if side == "read" else "a writer or readers hold it"
                raise TimeoutError(f"could not take the {side} side of the lock within {timeout:g} s: {held_by}")
            self._cond.wait(remaining)

    @contextmanager
    def read(self, timeout: Optional[float] = None) -> Iterator[None]:
        """Hold the read side for the ``with`` block (free inside the writer's own thread), waiting
        at most ``timeout`` seconds for a writer (None: forever), then :class:`TimeoutError`."""
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:  # the writer reading its own state
                owned = False
            else:
                self._wait_while(lambda: self._writer is not None or bool(self._waiting_writers), timeout, "read")
                self._readers += 1
                owned = True
        try:
            yield
        finally:
            if owned:
                with self._cond:
                    self._readers -= 1
                    if not self._readers:
                        self._cond.notify_all()

    @contextmanager
    def write(self, timeout: Optional[float] = None) -> Iterator[None]:
        """Hold the write side for the ``with`` block (re-entrant in the same thread), waiting at
        most ``timeout`` seconds for the holders (None: forever), then :class:`TimeoutError`."""
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._write_depth += 1
            else:
                self._waiting_writers += 1
                try:
                    self._wait_while(lambda: self._writer is not None or bool(self._readers), timeout, "write")
                except TimeoutError:
                    self._cond.notify_all()  # readers held back by this waiting writer go on
                    raise
                finally:
                    self._waiting_writers -= 1
                self._writer, self._write_depth = me, 1
        try:
            yield
        finally:
            with self._cond:
                self._write_depth -= 1
                if not self._write_depth:
                    self._writer = None
                    self._cond.notify_all()
