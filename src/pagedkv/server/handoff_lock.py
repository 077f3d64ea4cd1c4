"""The lock the server's step thread shares with request handlers, handed over between steps.

A plain ``threading.Lock`` is not fair: the step thread releases it at the end of a step and
takes it again at once for the next one, usually before a handler blocked in ``acquire`` has
run. Under a busy engine a handler then waits many steps (measured: ``/metrics`` took a median
300 ms and up to 1.1 s during a 1.5 s generation of the tiny test model; on a loaded machine
past a client's 2 s timeout), and so does ``add_request``, which delays a new request's first
token. ``HandoffLock`` counts the handlers waiting and makes the step thread let them in first.

Invariants:
  H1  mutual exclusion: at most one holder at a time (handlers and the step thread alike)
  H2  handoff: when the step thread asks for the lock (``for_step``) while handlers wait in
      ``acquire``, it takes the lock only after each of them has held it (``max_wait_s``
      bounds the wait for one that is never scheduled)
  H3  no starvation of the step thread: handlers that start ``acquire`` after the step thread
      asked wait until it has taken the lock, so between two steps each handler has at most
      one turn and a stream of arrivals cannot hold a step back
  H4  ``num_waiting`` counts the handlers between being let in (H3) and holding the lock
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import TracebackType


class HandoffLock:
    """A mutex for one step thread and any number of handler threads (see the module doc)."""

    def __init__(self, max_wait_s: float = 1.0) -> None:
        if max_wait_s <= 0:
            raise ValueError(f"max_wait_s must be > 0, got {max_wait_s}")
        self.max_wait_s = max_wait_s
        self._mutex = threading.Lock()
        self._gate = threading.Condition(threading.Lock())  # guards _num_waiting
        self._num_waiting = 0
        self._step_next = False  # H3: the step thread takes the lock before any new handler

    @property
    def num_waiting(self) -> int:
        """Handlers waiting for the lock now (H4)."""
        return self._num_waiting

    def acquire(self) -> None:
        """Take the lock as a handler: counted as waiting until it is held."""
        with self._gate:
            while self._step_next:
                self._gate.wait()
            self._num_waiting += 1
        try:
            self._mutex.acquire()
        finally:
            with self._gate:
                self._num_waiting -= 1
                if not self._num_waiting:
                    self._gate.notify_all()

    def release(self) -> None:
        self._mutex.release()

    def __enter__(self) -> HandoffLock:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    @contextmanager
    def for_step(self) -> Iterator[None]:
        """Hold the lock for one step, after the handlers waiting now have had it (H2, H3)."""
        with self._gate:
            self._step_next = True  # H3: later arrivals wait behind this step
            if self._num_waiting:
                self._gate.wait_for(lambda: not self._num_waiting, timeout=self.max_wait_s)
        try:
            self._mutex.acquire()
        finally:
            with self._gate:
                self._step_next = False
                self._gate.notify_all()
        try:
            yield
        finally:
            self._mutex.release()
