"""Offload coordinator: async writes, dedupe, full queue, match, load and promotion."""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.tiers import (
    PENDING,
    DiskTier,
    HostTier,
    KVTier,
    OffloadCoordinator,
    PayloadHeader,
    TierLayout,
    encode,
    payload_size,
)

LAYOUT = TierLayout("m", num_layers=1, num_kv_heads=1, head_dim=8, block_size=4)
SIZE = payload_size(LAYOUT)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def pl(i: int) -> bytes:
    return encode(PayloadHeader(LAYOUT, h(i), 4), bytes([i % 256]) * LAYOUT.block_bytes)


@pytest.fixture
def stack(tmp_path: Path) -> tuple[HostTier, DiskTier]:
    return HostTier(LAYOUT, 4 * SIZE), DiskTier(tmp_path, LAYOUT, 100 * SIZE)


class SlowTier(HostTier):
    """A host tier whose writes take ``delay_s`` (a stand-in for slow I/O)."""

    def __init__(self, delay_s: float) -> None:
        super().__init__(LAYOUT, 1000 * SIZE, name="slow")
        self.delay_s = delay_s

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> int:
        time.sleep(self.delay_s)
        return super().put_many(items)


class BrokenTier(HostTier):
    """A tier whose first write raises (a bug in a tier must not stop the writer)."""

    def __init__(self) -> None:
        super().__init__(LAYOUT, 1000 * SIZE, name="broken")
        self.fail = True

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> int:
        if self.fail:
            self.fail = False
            raise RuntimeError("boom")
        return super().put_many(items)


def test_submitted_blocks_reach_every_tier(stack: tuple[HostTier, DiskTier]) -> None:
    host, disk = stack
    off = OffloadCoordinator([host, disk])
    for i in range(3):
        assert off.submit(h(i), pl(i))
    assert off.flush(5)
    for i in range(3):
        assert host.contains(h(i))
        assert disk.contains(h(i))
    s = off.stats()
    assert (s.submitted, s.written, s.queue_len) == (3, 3, 0)
    off.check_invariants()
    off.close()


def test_queued_blocks_are_served_before_they_are_written(stack: tuple[HostTier, DiskTier]) -> None:
    host, disk = stack
    off = OffloadCoordinator([host, disk], start=False)
    off.submit(h(0), pl(0))
    off.submit(h(1), pl(1))
    assert off.match([h(0), h(1), h(2)]) == [(PENDING, h(0)), (PENDING, h(1))]
    assert off.load([h(0), h(1)]) == [pl(0), pl(1)]
    assert not host.contains(h(0))
    off.check_invariants()
    off.start()
    assert off.flush(5)
    assert disk.contains(h(1))
    off.close()


def test_duplicates_are_not_queued_twice(stack: tuple[HostTier, DiskTier]) -> None:
    host, disk = stack
    off = OffloadCoordinator([host, disk], start=False)
    assert off.submit(h(0), pl(0))
    assert not off.submit(h(0), pl(0))
    off.start()
    off.flush(5)
    assert not off.submit(h(0), pl(0))  # already in every local tier
    s = off.stats()
    assert (s.submitted, s.deduped, s.written) == (3, 2, 1)
    off.close()


def test_full_queue_drops_and_counts_without_waiting() -> None:
    slow = SlowTier(0.3)
    off = OffloadCoordinator([slow], max_queue_blocks=4, write_batch_blocks=1)
    t0 = time.perf_counter()
    accepted = [off.submit(h(i), pl(i)) for i in range(50)]
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.1  # the caller never waits on the 0.3 s writes
    assert sum(accepted) <= 5  # one being written + 4 queued
    s = off.stats()
    assert s.dropped_queue_full == 50 - sum(accepted)
    assert s.queue_len <= 4
    off.check_invariants()
    off.close(flush_timeout_s=5)


def test_match_walks_levels_and_stops_at_the_first_gap(stack: tuple[HostTier, DiskTier]) -> None:
    host, disk = stack
    host.put(h(0), pl(0))
    for i in (1, 2, 4):
        disk.put(h(i), pl(i))
    off = OffloadCoordinator([host, disk], start=False)
    off.submit(h(3), pl(3))
    hashes = [h(i) for i in range(6)]
    assert off.match(hashes) == [
        ("host", h(0)),
        ("disk", h(1)),
        ("disk", h(2)),
        (PENDING, h(3)),
        ("disk", h(4)),
    ]
    assert off.contains_prefix(hashes) == 5
    assert off.contains_prefix([h(5), h(0)]) == 0
    off.close(flush_timeout_s=0)


def test_load_promotes_lower_tier_blocks_upward(stack: tuple[HostTier, DiskTier]) -> None:
    host, disk = stack
    for i in range(3):
        disk.put(h(i), pl(i))
    off = OffloadCoordinator([host, disk])
    assert off.load([h(0), h(1), h(2), h(3)]) == [pl(0), pl(1), pl(2)]
    off.flush(5)
    assert host.contains_prefix([h(0), h(1), h(2)]) == 3
    s = off.stats()
    assert (s.loaded, s.promoted, s.load_failures) == (3, 3, 0)
    assert s.tiers[1].hits == 3
    assert off.match([h(0)]) == [("host", h(0))]
    off.check_invariants()
    off.close()


def test_load_stops_at_a_block_that_fails_its_checks(stack: tuple[HostTier, DiskTier]) -> None:
    host, disk = stack
    for i in range(3):
        disk.put(h(i), pl(i))
    path = Path(disk.path_of(h(1)))
    path.write_bytes(path.read_bytes()[:-1])
    off = OffloadCoordinator([host, disk], promote=False)
    assert off.load([h(0), h(1), h(2)]) == [pl(0)]
    s = off.stats()
    assert (s.loaded, s.load_failures) == (1, 1)
    assert s.tiers[1].corrupt == 1
    assert off.contains_prefix([h(0), h(1), h(2)]) == 1
    off.close()


def test_a_failing_tier_does_not_stop_the_writer() -> None:
    broken = BrokenTier()
    host = HostTier(LAYOUT, 100 * SIZE)
    off = OffloadCoordinator([broken, host], write_batch_blocks=1)
    off.submit(h(0), pl(0))
    off.submit(h(1), pl(1))
    assert off.flush(5)
    assert host.contains(h(0))  # the tier below still got the block
    assert broken.contains(h(1))
    assert off.stats().write_errors == 1
    off.close()


def test_closed_coordinator_drops_new_blocks(stack: tuple[HostTier, DiskTier]) -> None:
    off = OffloadCoordinator(list(stack))
    off.close()
    assert not off.submit(h(0), pl(0))
    assert off.stats().dropped_queue_full == 1


def test_bad_configuration_raises(stack: tuple[HostTier, DiskTier]) -> None:
    host, _ = stack
    tiers: Sequence[KVTier] = []
    with pytest.raises(InvalidRequestError):
        OffloadCoordinator(tiers)
    with pytest.raises(InvalidRequestError, match="unique"):
        OffloadCoordinator([host, host], start=False)
    with pytest.raises(InvalidRequestError):
        OffloadCoordinator([host], max_queue_blocks=0, start=False)


def test_a_tier_slower_than_recompute_is_skipped_then_reprobed(
    stack: tuple[HostTier, DiskTier],
) -> None:
    host, disk = stack
    for i in range(3):
        disk.put(h(i), pl(i))
    off = OffloadCoordinator([host, disk], promote=False, reprobe_every=3)
    hashes = [h(0), h(1), h(2)]
    assert len(off.load(hashes)) == 3  # measures the disk tier
    (level, s_per_block), *_ = off.stats().load_s_per_block
    assert level == "disk"
    assert s_per_block > 0
    off.set_recompute_cost(s_per_block / 1000)  # recompute is far cheaper than a disk load
    assert off.match(hashes) == []
    assert off.match(hashes) == []
    assert off.match(hashes) == [("disk", x) for x in hashes]  # the third walk probes again
    assert off.stats().skipped_slow == 2
    off.set_recompute_cost(None)
    assert off.contains_prefix(hashes) == 3
    with pytest.raises(InvalidRequestError):
        off.set_recompute_cost(0)
    off.close()


def test_block_written_between_match_and_load_is_still_loaded(
    stack: tuple[HostTier, DiskTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    host, disk = stack
    off = OffloadCoordinator([host, disk], start=False)
    off.submit(h(0), pl(0))
    stale = off.match([h(0)])
    assert stale == [(PENDING, h(0))]
    off.start()
    assert off.flush(5)  # the writer dequeued it: no longer pending
    monkeypatch.setattr(off, "match", lambda hashes: stale)
    assert off.load([h(0)]) == [pl(0)]
    assert off.stats().load_failures == 0
    off.close()


def test_fetch_serves_each_block_from_its_level_without_stopping_at_gaps(
    stack: tuple[HostTier, DiskTier],
) -> None:
    host, disk = stack
    host.put(h(0), pl(0))
    disk.put(h(2), pl(2))
    off = OffloadCoordinator([host, disk], start=False)
    off.submit(h(3), pl(3))
    assert off.fetch([h(0), h(1), h(2), h(3)]) == [pl(0), None, pl(2), pl(3)]
    s = off.stats()
    assert (s.loaded, s.load_failures, s.promoted) == (3, 1, 1)  # h(2) queued for the host tier
    assert disk.stats().misses == 0  # only blocks the disk index holds were read from it
    off.start()
    assert off.flush(5)
    assert host.contains(h(2))
    off.close()
