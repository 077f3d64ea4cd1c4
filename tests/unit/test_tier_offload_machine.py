"""The offload coordinator against a set model (hypothesis state machine).

A host tier too small for every block sits above a disk tier with room for all. Whatever the
interleaving of submits, flushes, loads, fetches and host deletions, a submitted block is never
lost (queued, or on disk), match/load see exactly the consecutive run the model predicts, and
every payload returned is the one submitted for that hash.
"""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.tiers import (
    DiskTier,
    HostTier,
    OffloadCoordinator,
    PayloadHeader,
    TierLayout,
    encode,
    payload_size,
)

LAYOUT = TierLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=2)
SIZE = payload_size(LAYOUT)
ids = st.integers(min_value=0, max_value=11)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def pl(i: int) -> bytes:
    return encode(PayloadHeader(LAYOUT, h(i), 2), bytes([i]) * LAYOUT.block_bytes)


class OffloadMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.root = tempfile.mkdtemp(prefix="offload-machine-")
        self.host = HostTier(LAYOUT, 3 * SIZE)
        self.disk = DiskTier(self.root, LAYOUT, 100 * SIZE)
        self.off = OffloadCoordinator([self.host, self.disk], max_queue_blocks=64)
        self.stored: set[int] = set()
        self.closed = False

    def run_from(self, start: int) -> int:
        n = 0
        while start + n in self.stored:
            n += 1
        return n

    @rule(i=ids)
    def submit(self, i: int) -> None:
        self.off.submit(h(i), pl(i))
        self.stored.add(i)

    @rule()
    def flush(self) -> None:
        assert self.off.flush(10)

    @rule(start=ids)
    def load(self, start: int) -> None:
        hashes = [h(j) for j in range(start, start + 5)]
        expected = min(5, self.run_from(start))
        assert len(self.off.match(hashes)) == expected
        assert self.off.load(hashes) == [pl(j) for j in range(start, start + expected)]

    @rule(picks=st.lists(ids, max_size=5))
    def fetch(self, picks: list[int]) -> None:
        got = self.off.fetch([h(j) for j in picks])
        assert got == [pl(j) if j in self.stored else None for j in picks]

    @rule(i=ids)
    def drop_from_host(self, i: int) -> None:
        self.host.delete(h(i))  # the disk copy still serves it

    @precondition(lambda self: not self.closed)
    @invariant()
    def consistent(self) -> None:
        self.off.check_invariants()
        assert self.off.contains_prefix([h(j) for j in range(12)]) == self.run_from(0)

    def teardown(self) -> None:
        self.off.close()
        self.closed = True
        shutil.rmtree(self.root, ignore_errors=True)


TestOffloadMachine = OffloadMachine.TestCase
TestOffloadMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
