"""Host and disk tiers against a naive LRU model (hypothesis state machines).

The model is an ordered list of block ids with a capacity in blocks (every payload of one layout
has the same size). After every step the tier must hold exactly the model's blocks, in the
model's LRU order, with the right bytes, within its budget; the disk tier also survives restarts
with the same order.
"""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedkv.tiers import (
    DiskTier,
    HostTier,
    KVTier,
    PayloadHeader,
    TierLayout,
    encode,
    payload_size,
)

LAYOUT = TierLayout("m", num_layers=1, num_kv_heads=1, head_dim=4, block_size=2)
SIZE = payload_size(LAYOUT)
CAPACITY_BLOCKS = 4
ids = st.integers(min_value=0, max_value=9)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def pl(i: int) -> bytes:
    return encode(PayloadHeader(LAYOUT, h(i), 2), bytes([i]) * LAYOUT.block_bytes)


class LRUModel:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: list[int] = []  # least recently used first

    def put(self, i: int) -> None:
        if i in self.order:
            self.order.remove(i)
        elif len(self.order) == self.capacity:
            self.order.pop(0)
        self.order.append(i)

    def get(self, i: int) -> bool:
        if i not in self.order:
            return False
        self.order.remove(i)
        self.order.append(i)
        return True

    def delete(self, i: int) -> bool:
        if i not in self.order:
            return False
        self.order.remove(i)
        return True


class TierMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.model = LRUModel(CAPACITY_BLOCKS)
        self.tier: KVTier = self.make_tier()

    def make_tier(self) -> KVTier:
        return HostTier(LAYOUT, CAPACITY_BLOCKS * SIZE + SIZE // 2)

    def lru(self) -> list[bytes]:
        assert isinstance(self.tier, HostTier | DiskTier)
        return self.tier.lru_order()

    @rule(i=ids)
    def put(self, i: int) -> None:
        assert self.tier.put(h(i), pl(i))
        self.model.put(i)

    @rule(i=ids)
    def get(self, i: int) -> None:
        expected = self.model.get(i)
        got = self.tier.try_get(h(i))
        assert got == (pl(i) if expected else None)

    @rule(i=ids)
    def delete(self, i: int) -> None:
        assert self.tier.delete(h(i)) == self.model.delete(i)

    @rule(start=ids)
    def prefix(self, start: int) -> None:
        hashes = [h(j) for j in range(start, start + 4)]
        run = 0
        while run < 4 and start + run in self.model.order:
            run += 1
        assert self.tier.contains_prefix(hashes) == run

    @invariant()
    def matches_model(self) -> None:
        assert self.lru() == [h(i) for i in self.model.order]
        stats = self.tier.stats()
        assert stats.num_bytes == len(self.model.order) * SIZE
        self.tier.check_invariants()


class DiskMachine(TierMachine):
    def make_tier(self) -> KVTier:
        self.root = tempfile.mkdtemp(prefix="tier-machine-")
        return DiskTier(self.root, LAYOUT, CAPACITY_BLOCKS * SIZE + SIZE // 2)

    @rule()
    def restart(self) -> None:
        self.tier.close()
        self.tier = DiskTier(self.root, LAYOUT, CAPACITY_BLOCKS * SIZE + SIZE // 2)

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


TestHostTierMachine = TierMachine.TestCase
TestHostTierMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
TestDiskTierMachine = DiskMachine.TestCase
TestDiskTierMachine.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
