"""Host RAM tier: round trip, byte budget, LRU order, counters."""

from __future__ import annotations

import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.tiers import HostTier, PayloadHeader, TierLayout, encode, payload_size

LAYOUT = TierLayout("m", num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)
SIZE = payload_size(LAYOUT)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def pl(i: int, layout: TierLayout = LAYOUT) -> bytes:
    body = bytes([i % 256]) * layout.block_bytes
    return encode(PayloadHeader(layout, h(i), layout.block_size), body)


def test_round_trip_and_counters() -> None:
    tier = HostTier(LAYOUT, 10 * SIZE)
    assert tier.put(h(1), pl(1))
    assert tier.try_get(h(1)) == pl(1)
    assert tier.try_get(h(2)) is None
    s = tier.stats()
    assert (s.hits, s.misses, s.bytes_in, s.bytes_out, s.num_blocks) == (1, 1, SIZE, SIZE, 1)
    tier.check_invariants()


def test_budget_evicts_least_recently_used_first() -> None:
    tier = HostTier(LAYOUT, 3 * SIZE)
    for i in range(3):
        tier.put(h(i), pl(i))
    assert tier.try_get(h(0)) is not None  # 0 becomes most recent
    tier.put(h(3), pl(3))
    assert tier.lru_order() == [h(2), h(0), h(3)]
    assert tier.try_get(h(1)) is None
    assert tier.stats().evictions == 1
    assert tier.num_bytes == 3 * SIZE
    tier.check_invariants()


def test_contains_prefix_stops_at_first_miss() -> None:
    tier = HostTier(LAYOUT, 10 * SIZE)
    for i in (0, 1, 3):
        tier.put(h(i), pl(i))
    assert tier.contains_prefix([h(0), h(1), h(2), h(3)]) == 2
    assert tier.contains_prefix([h(2), h(3)]) == 0
    assert tier.contains_prefix([]) == 0
    s = tier.stats()
    assert (s.lookup_hits, s.lookup_misses) == (2, 2)


def test_payload_over_budget_is_dropped_and_counted() -> None:
    tier = HostTier(LAYOUT, SIZE - 1)
    assert not tier.put(h(1), pl(1))
    assert tier.stats().dropped_writes == 1
    assert tier.num_blocks == 0


def test_put_twice_stores_once() -> None:
    tier = HostTier(LAYOUT, 10 * SIZE)
    assert tier.put(h(1), pl(1))
    assert tier.put(h(1), pl(1))
    assert tier.stats().bytes_in == SIZE
    assert tier.delete(h(1))
    assert not tier.delete(h(1))
    assert tier.num_bytes == 0
    tier.check_invariants()


def test_payload_of_another_layout_or_hash_is_refused() -> None:
    tier = HostTier(LAYOUT, 10 * SIZE)
    other = TierLayout("other", 1, 1, 8, 4)
    with pytest.raises(InvalidRequestError):
        tier.put(h(1), pl(1, other))
    with pytest.raises(InvalidRequestError):
        tier.put(h(2), pl(1))
    assert tier.num_blocks == 0
