"""Tiers report the blocks they gain and lose as KV events (medium: the tier's name)."""

from __future__ import annotations

from pathlib import Path

from pagedkv.core.events import BlockRemoved, BlockStored
from pagedkv.tiers import PayloadHeader, TierLayout, encode
from pagedkv.tiers.disk import DiskTier
from pagedkv.tiers.host import HostTier
from pagedkv.tiers.payload import payload_size

LAYOUT = TierLayout("m", num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)
SIZE = payload_size(LAYOUT)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def pl(i: int) -> bytes:
    return encode(PayloadHeader(LAYOUT, h(i), 4), bytes([i]) * LAYOUT.block_bytes)


def stored(i: int, medium: str) -> BlockStored:
    return BlockStored((h(i),), None, (), 4, medium=medium)


def test_events_are_off_until_enabled_and_then_name_stores_and_evictions() -> None:
    tier = HostTier(LAYOUT, 2 * SIZE)
    tier.put(h(0), pl(0))
    assert tier.drain_events() == []  # off by default: nothing queued
    tier.enable_events()
    tier.put(h(1), pl(1))
    tier.put(h(1), pl(1))  # already there: no event
    tier.put(h(2), pl(2))  # evicts block 0, the least recently used
    assert tier.delete(h(1))
    assert tier.drain_events() == [
        stored(1, "host"),
        BlockRemoved((h(0),), medium="host"),
        stored(2, "host"),
        BlockRemoved((h(1),), medium="host"),
    ]
    assert tier.drain_events() == []


def test_disk_tier_reports_writes_evictions_and_deletes(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, LAYOUT, 2 * SIZE)
    tier.enable_events()
    for i in range(3):
        assert tier.put(h(i), pl(i))
    assert tier.delete(h(2))
    assert tier.drain_events() == [
        stored(0, "disk"),
        stored(1, "disk"),
        BlockRemoved((h(0),), medium="disk"),
        stored(2, "disk"),
        BlockRemoved((h(2),), medium="disk"),
    ]
    tier.close()
