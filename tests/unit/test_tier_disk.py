"""Disk tier: round trip, exact budget and LRU order, restart, bad files, full disk, races."""

from __future__ import annotations

import errno
import logging
import os
import stat
import threading
import time
from pathlib import Path

import pytest

from pagedkv.errors import InvalidRequestError, InvariantViolation, TierUnavailableError
from pagedkv.tiers import DiskTier, FsyncPolicy, PayloadHeader, TierLayout, encode, payload_size
from pagedkv.tiers.disk_files import write_file

LAYOUT = TierLayout("m", num_layers=2, num_kv_heads=1, head_dim=16, block_size=4)
SIZE = payload_size(LAYOUT)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def pl(i: int, layout: TierLayout = LAYOUT) -> bytes:
    body = ((i % 2**32).to_bytes(4, "little") * (layout.block_bytes // 4 + 1))[: layout.block_bytes]
    return encode(PayloadHeader(layout, h(i), layout.block_size), body)


def files_of(root: Path, suffix: str = ".kvb") -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name.endswith(suffix))


def test_round_trip_file_layout_and_permissions(tmp_path: Path) -> None:
    root = tmp_path / "kv"
    tier = DiskTier(root, LAYOUT, 10 * SIZE)
    assert tier.put(h(0xAB << 120), pl(0xAB << 120))
    assert tier.try_get(h(0xAB << 120)) == pl(0xAB << 120)
    path = Path(tier.path_of(h(0xAB << 120)))
    assert path.parent.name == "ab"
    assert path.name.startswith("ab000000")
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.stat().st_size == SIZE
    s = tier.stats()
    assert (s.hits, s.bytes_in, s.bytes_out, s.num_blocks, s.num_bytes) == (1, SIZE, SIZE, 1, SIZE)
    tier.check_invariants()


def test_budget_is_exact_and_evicts_lru_files(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, LAYOUT, 3 * SIZE)
    for i in range(3):
        tier.put(h(i), pl(i))
    assert tier.try_get(h(0)) is not None
    assert tier.put(h(3), pl(3))
    assert tier.lru_order() == [h(2), h(0), h(3)]
    assert not Path(tier.path_of(h(1))).exists()
    assert sum(p.stat().st_size for p in files_of(tmp_path)) == tier.num_bytes == 3 * SIZE
    assert tier.stats().evictions == 1
    assert tier.contains_prefix([h(2), h(0), h(1), h(3)]) == 2
    tier.check_invariants()


def test_payload_larger_than_budget_is_dropped(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, LAYOUT, SIZE - 1)
    assert not tier.put(h(1), pl(1))
    assert tier.stats().dropped_writes == 1
    assert files_of(tmp_path) == []


def test_restart_sees_blocks_in_lru_order(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, LAYOUT, 4 * SIZE)
    for i in range(4):
        first.put(h(i), pl(i))
    first.try_get(h(1))
    first.try_get(h(0))
    first.close()
    second = DiskTier(tmp_path, LAYOUT, 4 * SIZE)
    assert second.lru_order() == [h(2), h(3), h(1), h(0)]
    assert second.num_bytes == 4 * SIZE
    assert second.try_get(h(3)) == pl(3)
    second.put(h(9), pl(9))  # evicts 2, the least recently used before the restart
    assert second.lru_order() == [h(1), h(0), h(3), h(9)]
    second.check_invariants()


def test_a_second_live_tier_on_the_same_folder_and_layout_is_refused(tmp_path: Path) -> None:
    first = DiskTier(tmp_path, LAYOUT, 4 * SIZE)
    with pytest.raises(TierUnavailableError, match="in use"):
        DiskTier(tmp_path, LAYOUT, 4 * SIZE)
    other = DiskTier(tmp_path, TierLayout("other", 2, 1, 16, 4), 4 * SIZE)  # another layout: fine
    other.close()
    first.close()
    DiskTier(tmp_path, LAYOUT, 4 * SIZE).close()


def test_restart_over_budget_evicts_lru_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = DiskTier(tmp_path, LAYOUT, 4 * SIZE)
    for i in range(4):
        first.put(h(i), pl(i))
    first.close()
    with caplog.at_level(logging.WARNING, logger="pagedkv.tiers.disk"):
        second = DiskTier(tmp_path, LAYOUT, 2 * SIZE)
    assert second.lru_order() == [h(2), h(3)]
    assert len(files_of(tmp_path)) == 2
    assert "evicted 2" in caplog.text


def test_leftover_temp_files_are_removed_at_start(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, LAYOUT, 4 * SIZE)
    tier.put(h(1), pl(1))
    sub = Path(tier.path_of(h(1))).parent
    ours = sub / f".{h(2).hex()}.{LAYOUT.tag}.123.1.tmp"
    theirs = sub / f".{h(2).hex()}.{'0' * 16}.123.1.tmp"
    ours.write_bytes(b"half a block")
    theirs.write_bytes(b"another layout's write")
    tier.close()
    again = DiskTier(tmp_path, LAYOUT, 4 * SIZE)
    assert not ours.exists()
    assert theirs.exists()
    assert again.num_temp_files_removed == 1
    assert again.lru_order() == [h(1)]


def test_foreign_layout_files_are_ignored_not_deleted(tmp_path: Path) -> None:
    other = TierLayout("other-model", 2, 1, 16, 4)
    theirs = DiskTier(tmp_path, other, 10 * SIZE)
    for i in range(3):
        theirs.put(h(i), pl(i, other))
    ours = DiskTier(tmp_path, LAYOUT, 2 * SIZE)
    assert ours.num_foreign_files == 3
    assert ours.num_blocks == 0
    assert ours.try_get(h(0)) is None
    for i in range(3):
        ours.put(h(10 + i), pl(10 + i))  # evictions never touch the other layout's files
    assert len(files_of(tmp_path, other.tag + ".kvb")) == 3
    assert ours.num_bytes == 2 * SIZE
    ours.check_invariants()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "other_block"])
def test_bad_file_is_a_miss_deleted_and_counted(tmp_path: Path, damage: str) -> None:
    tier = DiskTier(tmp_path, LAYOUT, 10 * SIZE)
    tier.put(h(1), pl(1))
    tier.put(h(2), pl(2))
    path = Path(tier.path_of(h(1)))
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    elif damage == "truncate":
        data = data[: len(data) - 7]
    elif damage == "empty":
        data = bytearray()
    else:
        data = bytearray(pl(2))  # a whole, valid payload of another block under this name
    path.write_bytes(bytes(data))
    assert tier.try_get(h(1)) is None
    assert not path.exists()
    s = tier.stats()
    assert (s.corrupt, s.misses, s.num_blocks, s.num_bytes) == (1, 1, 1, SIZE)
    assert tier.try_get(h(2)) == pl(2)
    tier.check_invariants()


def test_file_deleted_behind_the_tiers_back_is_a_miss(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, LAYOUT, 10 * SIZE)
    tier.put(h(1), pl(1))
    os.unlink(tier.path_of(h(1)))
    assert tier.try_get(h(1)) is None
    assert tier.num_blocks == 0
    tier.check_invariants()


class FullDisk:
    """A writer that fails with ENOSPC (or another errno) while ``full`` is set."""

    def __init__(self, code: int = errno.ENOSPC) -> None:
        self.full = True
        self.code = code
        self.calls = 0

    def __call__(self, path: str, data: bytes, fsync: bool) -> None:
        self.calls += 1
        if self.full:
            with open(path, "wb") as fh:  # a partial temp file, as a real full disk leaves
                fh.write(data[: len(data) // 2])
            raise OSError(self.code, os.strerror(self.code))
        write_file(path, data, fsync)


def test_full_disk_disables_writes_for_a_backoff_and_reads_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    writer = FullDisk()
    tier = DiskTier(tmp_path, LAYOUT, 10 * SIZE, writer=writer, clock=lambda: now[0])
    writer.full = False
    tier.put(h(1), pl(1))
    writer.full = True
    with caplog.at_level(logging.WARNING, logger="pagedkv.tiers.disk"):
        assert not tier.put(h(2), pl(2))
    assert "writes disabled" in caplog.text
    assert not tier.can_write()
    assert not tier.put(h(3), pl(3))  # not even attempted during the back-off
    assert writer.calls == 2
    assert tier.try_get(h(1)) == pl(1)
    assert files_of(tmp_path, ".tmp") == []  # the partial temp file was removed
    s = tier.stats()
    assert (s.dropped_writes, s.errors, s.num_blocks) == (2, 1, 1)
    writer.full = False
    now[0] = tier.write_backoff_s + 1
    assert tier.can_write()
    assert tier.put(h(3), pl(3))
    assert tier.try_get(h(3)) == pl(3)
    tier.check_invariants()


def test_other_write_errors_drop_the_block_but_keep_writes_on(tmp_path: Path) -> None:
    writer = FullDisk(errno.EIO)
    tier = DiskTier(tmp_path, LAYOUT, 10 * SIZE, writer=writer)
    assert not tier.put(h(1), pl(1))
    assert tier.can_write()
    writer.full = False
    assert tier.put(h(1), pl(1))
    tier.check_invariants()


@pytest.mark.parametrize("policy", list(FsyncPolicy))
def test_every_fsync_policy_stores_blocks(tmp_path: Path, policy: FsyncPolicy) -> None:
    tier = DiskTier(tmp_path, LAYOUT, 10 * SIZE, fsync=policy.value)
    assert tier.put(h(1), pl(1))
    assert tier.try_get(h(1)) == pl(1)


def test_bad_arguments_raise(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="fsync"):
        DiskTier(tmp_path, LAYOUT, SIZE, fsync="sometimes")
    with pytest.raises(InvalidRequestError, match="capacity"):
        DiskTier(tmp_path, LAYOUT, 0)
    tier = DiskTier(tmp_path, LAYOUT, 10 * SIZE)
    with pytest.raises(InvalidRequestError):
        tier.put(h(2), pl(1))


def test_invariants_catch_a_stray_file(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, LAYOUT, 10 * SIZE)
    tier.put(h(1), pl(1))
    stray = Path(tier.path_of(h(7)))
    stray.write_bytes(pl(7))
    with pytest.raises(InvariantViolation, match="I4"):
        tier.check_invariants()


def test_block_being_written_reads_as_miss_never_partial(tmp_path: Path) -> None:
    started, release = threading.Event(), threading.Event()

    def slow_writer(path: str, data: bytes, fsync: bool) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, data[:100])
        started.set()
        release.wait(5)
        os.write(fd, data[100:])
        os.close(fd)

    tier = DiskTier(tmp_path, LAYOUT, 10 * SIZE, writer=slow_writer)
    t = threading.Thread(target=tier.put, args=(h(1), pl(1)))
    t.start()
    assert started.wait(5)
    assert tier.try_get(h(1)) is None
    assert tier.contains_prefix([h(1)]) == 0
    assert not Path(tier.path_of(h(1))).exists()
    assert tier.put(h(1), pl(1))  # already being written: not written twice
    release.set()
    t.join(5)
    assert tier.try_get(h(1)) == pl(1)
    tier.check_invariants()


def test_concurrent_writes_evictions_and_reads_never_return_partial(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, LAYOUT, 8 * SIZE)
    stop = time.monotonic() + 1.0
    bad: list[str] = []

    def writer() -> None:
        i = 0
        while time.monotonic() < stop:
            tier.put(h(i % 32), pl(i % 32))
            if i % 7 == 0:
                tier.delete(h((i * 5) % 32))
            i += 1

    def reader() -> None:
        j = 0
        while time.monotonic() < stop:
            got = tier.try_get(h(j % 32))
            if got is not None and got != pl(j % 32):
                bad.append(f"block {j % 32}: {len(got)} bytes")
            j += 1

    threads = [threading.Thread(target=f) for f in (writer, writer, reader, reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []
    s = tier.stats()
    assert s.hits > 0
    assert s.corrupt == 0
    tier.check_invariants()


def test_scan_of_thousands_of_blocks_is_fast(tmp_path: Path) -> None:
    layout = TierLayout("m", 1, 1, 1, 1, "uint8")
    tier = DiskTier(tmp_path, layout, 1 << 30)
    n = 2000
    for i in range(n):
        tier.put(h(i * 7919), encode(PayloadHeader(layout, h(i * 7919), 1), b"\0\0"))
    tier.close()
    again = DiskTier(tmp_path, layout, 1 << 30)
    assert again.num_blocks == n
    assert again.lru_order() == tier.lru_order()
    assert again.scan_s < 2.0  # ~0.05 s; generous for a loaded CI box (bench: 100,000 blocks)
