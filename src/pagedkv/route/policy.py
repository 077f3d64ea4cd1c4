"""Routing policies: which engine gets a request, from its block hashes and the engines' load.

Pure functions of their inputs (plus a round-robin cursor): no I/O, no clock, so the router and
the simulator run the same code. An engine is named by any hashable id (the router uses its
URL, the simulator a replica index).

``cache-aware`` is SGLang's cache-aware policy over block hashes instead of characters::

    loads = engines' load (running + waiting requests)
    if max(loads) - min(loads) > balance_abs_threshold
       and max(loads) > min(loads) * balance_rel_threshold:      # the system is imbalanced
        -> the least loaded engine
    else if the longest cached prefix / request blocks > cache_threshold:
        -> the engine holding that prefix (ties: least loaded)
    else:
        -> the engine with the fewest cached blocks (the most room; ties: least loaded)

Defaults are SGLang router's (``cache_threshold=0.3``, ``balance_abs_threshold=64``,
``balance_rel_threshold=1.5``); ``pagedkv router`` takes each as a flag.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from pagedkv.errors import InvalidRequestError, OverloadedError
from pagedkv.route.index import PrefixIndex

E = TypeVar("E", bound=Hashable)

POLICY_NAMES = ("cache-aware", "least-load", "round-robin")


@dataclass(frozen=True, slots=True)
class EngineLoad(Generic[E]):
    """One routable engine and its load (requests running plus waiting on it)."""

    engine: E
    load: int


@dataclass(frozen=True, slots=True)
class Decision(Generic[E]):
    """Where a request goes, and why: ``matched_blocks`` of the request's ``num_blocks`` are
    cached there; ``reason`` is ``"cache"``, ``"balance"``, ``"room"``, ``"load"`` or
    ``"round-robin"``."""

    engine: E
    matched_blocks: int
    num_blocks: int
    reason: str


class RoutingPolicy(Protocol[E]):
    def choose(
        self, block_hashes: Sequence[bytes], engines: Sequence[EngineLoad[E]]
    ) -> Decision[E]: ...


@dataclass(frozen=True, slots=True)
class CacheAwareConfig:
    """SGLang's thresholds (see the module docstring)."""

    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5

    def __post_init__(self) -> None:
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise InvalidRequestError(
                f"cache_threshold must be in [0, 1], got {self.cache_threshold}"
            )
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise InvalidRequestError(
                "need balance_abs_threshold >= 0 and balance_rel_threshold >= 1, got "
                f"{self.balance_abs_threshold}, {self.balance_rel_threshold}"
            )


def _need(engines: Sequence[EngineLoad[E]]) -> None:
    if not engines:
        raise OverloadedError("no healthy engine to route to")


def _least_loaded(engines: Sequence[EngineLoad[E]]) -> E:
    return min(engines, key=lambda e: e.load).engine  # first of the least loaded: stable


class RoundRobin(Generic[E]):
    """Each request to the next engine in turn (over the engines given, in their order)."""

    def __init__(self) -> None:
        self._next = 0

    def choose(
        self, block_hashes: Sequence[bytes], engines: Sequence[EngineLoad[E]]
    ) -> Decision[E]:
        _need(engines)
        pick = engines[self._next % len(engines)].engine
        self._next += 1
        return Decision(pick, 0, len(block_hashes), "round-robin")


class LeastLoad(Generic[E]):
    """The engine with the fewest running plus waiting requests (the first of equals)."""

    def choose(
        self, block_hashes: Sequence[bytes], engines: Sequence[EngineLoad[E]]
    ) -> Decision[E]:
        _need(engines)
        return Decision(_least_loaded(engines), 0, len(block_hashes), "load")


class CacheAware(Generic[E]):
    """SGLang's cache-aware policy over a :class:`PrefixIndex` (module docstring)."""

    def __init__(self, index: PrefixIndex[E], config: CacheAwareConfig | None = None) -> None:
        self.index = index
        self.config = config or CacheAwareConfig()

    def choose(
        self, block_hashes: Sequence[bytes], engines: Sequence[EngineLoad[E]]
    ) -> Decision[E]:
        _need(engines)
        cfg = self.config
        n = len(block_hashes)
        matches = self.index.match(block_hashes)
        loads = [e.load for e in engines]
        lo, hi = min(loads), max(loads)
        if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
            pick = _least_loaded(engines)
            return Decision(pick, matches.get(pick, 0), n, "balance")
        best = max((matches.get(e.engine, 0) for e in engines), default=0)
        if n and best / n > cfg.cache_threshold:
            holders = [e for e in engines if matches.get(e.engine, 0) == best]
            return Decision(_least_loaded(holders), best, n, "cache")
        room = min(engines, key=lambda e: (self.index.num_blocks(e.engine), e.load))
        return Decision(room.engine, matches.get(room.engine, 0), n, "room")


def make_policy(
    name: str, index: PrefixIndex[E], config: CacheAwareConfig | None = None
) -> RoutingPolicy[E]:
    """The policy called ``name`` (one of :data:`POLICY_NAMES`)."""
    if name == "cache-aware":
        return CacheAware(index, config)
    if name == "least-load":
        return LeastLoad()
    if name == "round-robin":
        return RoundRobin()
    raise InvalidRequestError(f"unknown routing policy {name!r}; choose one of {POLICY_NAMES}")
