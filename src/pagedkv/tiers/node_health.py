"""Per-node back-off for a remote tier: a node that fails is skipped for a while, the rest serve.

A remote tier talks to one server or to the masters of a cluster. When one of them fails (a
refused connection, a timeout, a ``CLUSTERDOWN`` reply) only that node is put in back-off: the
keys it serves read as misses and their writes are dropped without touching the network, while
every other node keeps serving. The back-off doubles on each failure from ``initial_s`` up to
``max_s``; once it has run out the next operation that touches the node tries it again (the
re-probe), and a success forgets the node's failures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pagedkv.errors import InvalidRequestError, InvariantViolation


@dataclass(slots=True)
class _Failing:
    """A node that failed and has not succeeded since."""

    down_until: float  # the re-probe time: before it, the node is skipped
    backoff_s: float  # the wait after the next failure (already doubled); I1


class NodeBackoff:
    """Back-off state per node name (``host:port``); a node without an entry is healthy.

    Invariants (check_invariants() verifies each):
      I1  every failing node's next back-off lies in [initial_s, max_s]
      I2  every failing node's re-probe time is at most max_s after the last failure's clock
    Complexity: every query and update O(1); ``down_names`` O(failing nodes).
    Not thread-safe on its own: the owning tier calls it under its lock.
    """

    def __init__(self, initial_s: float, max_s: float, clock: Callable[[], float]) -> None:
        if not 0 < initial_s <= max_s:
            raise InvalidRequestError(
                f"need 0 < backoff_initial_s <= backoff_max_s, got {initial_s}, {max_s}"
            )
        self.initial_s = initial_s
        self.max_s = max_s
        self._clock = clock
        self._failing: dict[str, _Failing] = {}
        self._last_failure_at = 0.0  # for I2

    def is_down(self, name: str) -> bool:
        """True while ``name`` is in back-off (before its re-probe time)."""
        state = self._failing.get(name)
        return state is not None and self._clock() < state.down_until

    def any_down(self) -> bool:
        return any(self.is_down(name) for name in self._failing)

    def down_names(self) -> list[str]:
        """The nodes in back-off now, sorted."""
        return sorted(name for name in self._failing if self.is_down(name))

    def failed(self, name: str) -> float:
        """Record a failure of ``name``; returns the back-off it now waits (seconds)."""
        now = self._clock()
        state = self._failing.get(name)
        wait = self.initial_s if state is None else state.backoff_s
        self._failing[name] = _Failing(now + wait, min(wait * 2, self.max_s))
        self._last_failure_at = max(self._last_failure_at, now)
        return wait

    def succeeded(self, name: str) -> bool:
        """Record a success of ``name``; True if it had been failing (it recovered)."""
        return self._failing.pop(name, None) is not None

    def check_invariants(self) -> None:
        for name, state in self._failing.items():
            if not self.initial_s <= state.backoff_s <= self.max_s:
                raise InvariantViolation(
                    f"I1: node {name} back-off {state.backoff_s} outside "
                    f"[{self.initial_s}, {self.max_s}]"
                )
            if state.down_until > self._last_failure_at + self.max_s:
                raise InvariantViolation(
                    f"I2: node {name} re-probes at {state.down_until}, more than {self.max_s} s "
                    f"after the last failure at {self._last_failure_at}"
                )
