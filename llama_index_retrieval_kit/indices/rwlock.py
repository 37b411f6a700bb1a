"""A small readers-writer lock: many readers at once, a writer alone (writers preferred).

``HybridIndex`` holds the write side while an update changes Qdrant, BM25 and the docstore, and
the queries that read Qdrant directly hold the read side, so a query sees the index before or
after an update, never a mix (Qdrant points are overwritten in place, BM25 swaps snapshots).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator


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

    @contextmanager
    def read(self) -> Iterator[None]:
        """Hold the read side for the ``with`` block (free inside the writer's own thread)."""
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:  # the writer reading its own state
                owned = False
            else:
                while self._writer is not None or self._waiting_writers:
                    self._cond.wait()
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
    def write(self) -> Iterator[None]:
        """Hold the write side for the ``with`` block (re-entrant in the same thread)."""
        me = threading.get_ident()
        with self._cond:
            if self._writer == me:
                self._write_depth += 1
            else:
                self._waiting_writers += 1
                try:
                    while self._writer is not None or self._readers:
                        self._cond.wait()
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
