"""The router's view of every engine's cache: block hash -> the engines that hold it.

Fed by each engine's KV events (``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared``) and
asked, per request, how long a prefix of its block hashes each engine holds. Pure data: no I/O,
no clock, so the simulator runs the same index as the router.

Which media count: a block in an engine's device pool (``GPU``) or in its own host RAM or disk
tier (``cpu``, ``disk``) is a hit on that engine (a tier load is cheaper than recomputing). A
shared Redis tier (``redis``) is reachable by every engine alike, so it says nothing about where
to route and is ignored.

Because a hash names its whole prefix (the chain), "the engine holds block i" implies nothing
about block i-1 on its own; :meth:`PrefixIndex.match` therefore counts a run from the first
block, as the engine's own prefix match does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Generic, TypeVar

from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagedkv.errors import InvalidRequestError, InvariantViolation

E = TypeVar("E", bound=Hashable)

ROUTED = "routed"
"""The medium of a router's own guess: blocks a request routed to an engine will store there.
It makes a burst of one prefix go to one engine before that engine's first event arrives;
any removal of the block on that engine (or its clear, or its failure) drops the guess too."""

LOCAL_MEDIA = frozenset({"GPU", "device", "cpu", "host", "disk", ROUTED})
"""Media that are local to one engine (a hit there is a hit on that engine only)."""


def is_local_medium(medium: str | None) -> bool:
    """vLLM sends ``None`` for its device pool in older versions: that is local too."""
    return medium is None or medium in LOCAL_MEDIA


class PrefixIndex(Generic[E]):
    """Block hash -> engines holding it, per medium, with per-engine counts kept incrementally.

    Invariants (check_invariants() verifies each):
      X1  e in holders[h]  <=>  h in held[e] (and held[e][h] is a non-empty set of media)
      X2  len(routed) <= max_routed (routed guesses are bounded: a guess the engine never
          confirms nor removes, say for a request it refused, ages out oldest first)
    Complexity: store/remove O(blocks in the event); match O(prefix length x engines holding);
    drop_engine O(blocks the engine held); num_blocks O(1).
    """

    def __init__(self, max_routed: int = 1 << 16) -> None:
        if max_routed <= 0:
            raise InvalidRequestError(f"max_routed must be positive, got {max_routed}")
        self._holders: dict[bytes, set[E]] = {}
        self._held: dict[E, dict[bytes, set[str]]] = {}
        self.max_routed = max_routed
        self._routed: OrderedDict[tuple[E, bytes], None] = OrderedDict()  # X2; may be stale

    # ------------------------------------------------------------------ events
    def add_engine(self, engine: E) -> None:
        self._held.setdefault(engine, {})

    def store(self, engine: E, block_hashes: Iterable[bytes], medium: str | None) -> None:
        if not is_local_medium(medium):
            return
        held = self._held.setdefault(engine, {})
        m = medium or "GPU"
        for h in block_hashes:
            media = held.get(h)
            if media is None:
                held[h] = {m}
                self._holders.setdefault(h, set()).add(engine)
            else:
                media.add(m)

    def remove(self, engine: E, block_hashes: Iterable[bytes], medium: str | None) -> None:
        held = self._held.get(engine)
        if held is None or not is_local_medium(medium):
            return
        m = medium or "GPU"
        for h in block_hashes:
            self._discard(engine, held, h, (m, ROUTED))

    def _discard(
        self, engine: E, held: dict[bytes, set[str]], h: bytes, media: Sequence[str]
    ) -> None:
        have = held.get(h)
        if have is None:
            return
        have.difference_update(media)
        if not have:
            del held[h]
            self._unhold(h, engine)

    def note_routed(self, engine: E, block_hashes: Iterable[bytes]) -> None:
        """Record the router's guess that ``engine`` will hold ``block_hashes`` (see ROUTED);
        past ``max_routed`` guesses the oldest is forgotten."""
        hashes = list(block_hashes)
        self.store(engine, hashes, ROUTED)
        routed = self._routed
        for h in hashes:
            routed[engine, h] = None
            routed.move_to_end((engine, h))
        while len(routed) > self.max_routed:
            (old_engine, old_hash), _ = routed.popitem(last=False)
            held = self._held.get(old_engine)
            if held is not None:
                self._discard(old_engine, held, old_hash, (ROUTED,))

    def clear(self, engine: E, medium: str | None = None) -> None:
        """Forget the engine's blocks on ``medium`` (every local medium when None)."""
        held = self._held.get(engine)
        if held is None:
            return
        for h in list(held):
            media = held[h]
            if medium is None:
                media.clear()
            else:
                media.discard(medium)
                media.discard(ROUTED)
            if not media:
                del held[h]
                self._unhold(h, engine)

    def drop_engine(self, engine: E) -> None:
        """Forget an engine entirely (it failed or left)."""
        for h in self._held.pop(engine, {}):
            self._unhold(h, engine)

    def _unhold(self, block_hash: bytes, engine: E) -> None:
        holders = self._holders[block_hash]
        holders.discard(engine)
        if not holders:
            del self._holders[block_hash]

    # ------------------------------------------------------------------ queries
    def match(self, block_hashes: Sequence[bytes]) -> dict[E, int]:
        """For each engine holding the first block: how many leading blocks it holds."""
        if not block_hashes:
            return {}
        first = self._holders.get(block_hashes[0])
        if not first:
            return {}
        alive = set(first)
        out = dict.fromkeys(alive, 1)
        for h in block_hashes[1:]:
            holders = self._holders.get(h)
            alive = alive & holders if holders else set()
            if not alive:
                break
            for e in alive:
                out[e] += 1
        return out

    def num_blocks(self, engine: E) -> int:
        return len(self._held.get(engine, ()))

    @property
    def engines(self) -> list[E]:
        return list(self._held)

    def check_invariants(self) -> None:
        for e, held in self._held.items():
            for h, media in held.items():
                if not media or e not in self._holders.get(h, ()):
                    raise InvariantViolation(f"X1: {e!r} holds {h.hex()} but is not a holder")
        for h, holders in self._holders.items():
            for e in holders:
                if h not in self._held.get(e, {}):
                    raise InvariantViolation(f"X1: {e!r} is a holder of {h.hex()} it lacks")
        if len(self._routed) > self.max_routed:
            raise InvariantViolation(f"X2: {len(self._routed)} guesses > {self.max_routed}")


def apply_events(index: PrefixIndex[E], engine: E, events: Iterable[KVEvent]) -> None:
    """Apply an engine's core KV events (as drained from its pool) to ``index``; the router
    applies the same events decoded from the wire, the simulator these directly."""
    for event in events:
        if isinstance(event, BlockStored):
            index.store(engine, event.block_hashes, event.medium)
        elif isinstance(event, BlockRemoved):
            index.remove(engine, event.block_hashes, event.medium)
        elif isinstance(event, AllBlocksCleared):
            index.clear(engine, event.medium)
