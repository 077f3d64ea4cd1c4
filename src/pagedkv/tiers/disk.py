"""The local-disk tier: one file per block, an in-memory LRU index rebuilt from a scan at start.

File names, the writer and the scan are in :mod:`pagedkv.tiers.disk_files`: one file per block
named by its hex hash and layout tag, fanned out into subfolders by the first two hex digits;
files of another model or layout are ignored (by name) and never deleted. The restart scan needs
one ``stat`` per file and no reads (100,000 blocks in well under a second, see
benchmarks/RESULTS.md).

Writes go to a temporary file that is renamed over the final name (``os.replace`` is atomic), so
a reader sees a whole block or none; a crash leaves at worst a temp file (removed at start) or,
without fsync, a torn file that fails its checksum and becomes a miss. That is why the default
fsync policy is ``none``: the checksum makes a lost write harmless, and fsync costs a device
flush per block. ``file`` and ``file+dir`` make a stored block survive power loss.

LRU order survives restarts through each file's mtime: a write sets it and every hit refreshes
it (``os.utime``), so the scan sorts by it. ``atime`` is not used (``relatime``/``noatime``).

The budget counts file sizes (each file is exactly its payload) and is enforced before each
write: least recently used blocks are deleted first, and a write in progress reserves its bytes.
A full disk (``ENOSPC``/``EDQUOT``/``EROFS``) disables writes for ``write_backoff_s`` with one
warning; reads keep being served.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from pagedkv.errors import CorruptBlockError, InvalidRequestError, InvariantViolation
from pagedkv.tiers.base import LocalTier
from pagedkv.tiers.disk_files import (
    BLOCK_SUFFIX,
    DISK_FULL_ERRNOS,
    FileWriter,
    FsyncPolicy,
    fsync_dir,
    lock_folder,
    open_root,
    scan,
    unlink_quietly,
    write_file,
)
from pagedkv.tiers.payload import TierLayout, decode, read_header

logger = logging.getLogger(__name__)


class DiskTier(LocalTier[int]):
    """Block payloads as files under ``root``, with an exact byte budget and LRU eviction.

    Invariants (check_invariants() verifies each):
      I1  num_bytes == sum of the sizes in the index
      I2  num_bytes + reserved bytes (writes in progress) <= capacity_bytes
      I3  every indexed block has its file, of the indexed size
      I4  every file of this layout under root is indexed or being written
      I5  no block is both indexed and being written
    Complexity: contains_prefix O(run) in memory; put/try_get one file each plus O(1) index
    work; eviction O(1) per evicted block; start-up O(files) stats and one sort.
    One live DiskTier per folder and layout: two would not see each other's writes and would
    overrun the budget together, so a second one (in any process) raises TierUnavailableError
    (an ``flock`` on ``root/.lock.<tag>``, released by ``close()`` or when the process exits).
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        layout: TierLayout,
        capacity_bytes: int,
        *,
        fsync: FsyncPolicy | str = FsyncPolicy.NONE,
        write_backoff_s: float = 30.0,
        writer: FileWriter = write_file,
        clock: Callable[[], float] = time.monotonic,
        name: str = "disk",
    ) -> None:
        super().__init__(name, layout, capacity_bytes)  # _lru: hash -> file size, LRU first
        if write_backoff_s < 0:
            raise InvalidRequestError(f"write_backoff_s must be >= 0, got {write_backoff_s}")
        try:
            self.fsync = FsyncPolicy(fsync)
        except ValueError:
            names = ", ".join(p.value for p in FsyncPolicy)
            raise InvalidRequestError(f"unknown fsync policy {fsync!r}; use {names}") from None
        self.root = Path(root)
        self.write_backoff_s = write_backoff_s
        self._writer = writer
        self._clock = clock
        self._tag = layout.tag
        self._suffix = f".{self._tag}{BLOCK_SUFFIX}"
        self._writing: dict[bytes, int] = {}  # hash -> size, writes in progress (I5)
        self._reserved = 0  # sum(_writing.values())
        self._disabled_until: float | None = None  # writes off until this clock time
        self._seq = 0
        self._last_stamp_ns = 0  # mtimes we set are strictly increasing (LRU across restarts)
        self._subdirs: set[str] = set()
        self.num_foreign_files = 0
        self.num_temp_files_removed = 0
        self.scan_s = 0.0
        self._lock_fd: int | None = None
        self._open_root()
        self._scan()

    # ------------------------------------------------------------------ start-up
    def _open_root(self) -> None:
        mode = open_root(self.root)
        if mode & 0o077:
            logger.warning("disk tier folder %s has mode %o; 0700 is recommended", self.root, mode)
        self._lock_fd = lock_folder(self.root, self._tag)

    def _scan(self) -> None:
        """Index this layout's blocks by last use; remove our leftover temp files."""
        t0 = time.perf_counter()
        found = scan(self.root, self._tag)
        self._subdirs |= found.subdirs
        self.num_foreign_files = found.num_foreign_files
        self.num_temp_files_removed = found.num_temp_files_removed
        entries = found.entries
        if entries:
            self._last_stamp_ns = entries[-1][0]
        for _, h, size in entries:
            self._lru[h] = size
            self._num_bytes += size
        if self.num_temp_files_removed:
            logger.info(
                "disk tier %s: removed %d leftover temp files",
                self.root,
                self.num_temp_files_removed,
            )
        evicted = 0
        while self._num_bytes > self.capacity_bytes:
            self._evict_one()
            evicted += 1
        if evicted:
            logger.warning(
                "disk tier %s held more than its budget of %d bytes; evicted %d least recently "
                "used blocks at start-up",
                self.root,
                self.capacity_bytes,
                evicted,
            )
        self.scan_s = time.perf_counter() - t0
        logger.info(
            "disk tier %s: %d blocks, %d bytes indexed in %.3f s (%d files of other layouts)",
            self.root,
            len(self._lru),
            self._num_bytes,
            self.scan_s,
            self.num_foreign_files,
        )

    # ------------------------------------------------------------------ paths
    def path_of(self, block_hash: bytes) -> str:
        hexhash = block_hash.hex()
        return os.path.join(self.root, hexhash[:2], hexhash + self._suffix)

    def _subdir(self, block_hash: bytes) -> str:
        sub = os.path.join(self.root, block_hash.hex()[:2])
        if sub not in self._subdirs:
            os.makedirs(sub, mode=0o700, exist_ok=True)
            self._subdirs.add(sub)
        return sub

    def _next_stamp_ns(self) -> int:
        """A strictly increasing wall-clock time for the next mtime (lock held). File times
        tick with the kernel's coarse clock (milliseconds), so two blocks written in one tick
        would otherwise tie and lose their order on restart."""
        self._last_stamp_ns = max(time.time_ns(), self._last_stamp_ns + 1)
        return self._last_stamp_ns

    def _touch(self, block_hash: bytes) -> None:
        """Stamp the file's mtime (lock held, so stamps follow the index order): the LRU clock
        that survives restarts. A file gone meanwhile is left to the next read."""
        stamp = self._next_stamp_ns()
        with contextlib.suppress(OSError):
            os.utime(self.path_of(block_hash), ns=(stamp, stamp))

    def _evict_one(self) -> None:
        """Delete the least recently used block (lock held)."""
        h, size = self._lru.popitem(last=False)
        self._num_bytes -= size
        self._counters.evictions += 1
        self._event_removed(h)
        try:
            unlink_quietly(self.path_of(h))
        except OSError as exc:
            self._counters.errors += 1
            logger.warning("disk tier: could not delete evicted block %s: %s", h.hex(), exc)

    # ------------------------------------------------------------------ queries
    def can_write(self) -> bool:
        """False while writes are disabled after a full disk."""
        with self._lock:
            return self._writes_enabled()

    def _writes_enabled(self) -> bool:
        if self._disabled_until is None:
            return True
        if self._clock() >= self._disabled_until:
            self._disabled_until = None
            logger.info("disk tier %s: writes enabled again", self.root)
            return True
        return False

    # ------------------------------------------------------------------ reads
    def try_get(self, block_hash: bytes) -> bytes | None:
        with self._lock:
            if block_hash not in self._lru:
                self._counters.misses += 1
                return None
            self._lru.move_to_end(block_hash)
        path = self.path_of(block_hash)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            self._forget(block_hash, None, "its file is gone")
            return None
        except OSError as exc:
            self._read_failed(block_hash, exc)
            return None
        try:
            st = os.fstat(fd)
            inode = st.st_ino
            data = os.read(fd, st.st_size)  # one copy from the page cache
            if len(data) != st.st_size:  # a short read: only from an odd file system
                parts = [data]
                while chunk := os.read(fd, 1 << 20):
                    parts.append(chunk)
                data = b"".join(parts)
        except OSError as exc:
            self._read_failed(block_hash, exc)
            return None
        finally:
            os.close(fd)
        try:
            decode(data, self.layout, block_hash)
        except CorruptBlockError as exc:
            self._forget(block_hash, inode, str(exc), corrupt=True)
            return None
        with self._lock:
            self._touch(block_hash)
            self._counters.hits += 1
            self._counters.bytes_out += len(data)
        return data

    def _read_failed(self, block_hash: bytes, exc: OSError) -> None:
        logger.warning("disk tier: reading block %s failed: %s", block_hash.hex(), exc)
        with self._lock:
            self._counters.errors += 1
            self._counters.misses += 1

    def _forget(
        self, block_hash: bytes, inode: int | None, why: str, corrupt: bool = False
    ) -> None:
        """Drop a block whose file is missing or bad; delete the file if it is still the one
        read (``inode``), so a fresh copy written meanwhile survives."""
        path = self.path_of(block_hash)
        with self._lock:
            self._counters.misses += 1
            if corrupt:
                self._counters.corrupt += 1
            else:
                self._counters.errors += 1
            same = inode is None
            if inode is not None:
                try:
                    same = os.stat(path).st_ino == inode
                except FileNotFoundError:
                    same = True
                if same:
                    unlink_quietly(path)
            if same and block_hash in self._lru:
                self._num_bytes -= self._lru.pop(block_hash)
                self._event_removed(block_hash)
        logger.warning("disk tier: block %s is a miss: %s", block_hash.hex(), why)

    # ------------------------------------------------------------------ writes
    def put(self, block_hash: bytes, payload: bytes) -> bool:
        header = read_header(payload)
        if header.layout != self.layout or header.block_hash != block_hash:
            raise InvalidRequestError(
                f"payload for block {header.block_hash.hex()} ({header.layout.namespace}) "
                f"cannot be stored as {block_hash.hex()} in tier {self.layout.namespace}"
            )
        size = len(payload)
        with self._lock:
            if block_hash in self._lru:  # a put of a stored block counts as a use
                self._lru.move_to_end(block_hash)
                self._touch(block_hash)
                return True
            if block_hash in self._writing:
                return True
            if size > self.capacity_bytes or not self._writes_enabled():
                self._counters.dropped_writes += 1
                return False
            while self._lru and self._num_bytes + self._reserved + size > self.capacity_bytes:
                self._evict_one()
            if self._num_bytes + self._reserved + size > self.capacity_bytes:
                self._counters.dropped_writes += 1  # the rest is reserved by writes in progress
                return False
            self._writing[block_hash] = size
            self._reserved += size
            self._seq += 1
            seq = self._seq
        try:
            sub = self._subdir(block_hash)
            hexhash = block_hash.hex()
            tmp = os.path.join(sub, f".{hexhash}.{self._tag}.{os.getpid()}.{seq}.tmp")
            final = os.path.join(sub, hexhash + self._suffix)
            try:
                self._writer(tmp, payload, self.fsync is not FsyncPolicy.NONE)
                os.replace(tmp, final)
            except BaseException:
                unlink_quietly(tmp)
                raise
            if self.fsync is FsyncPolicy.FILE_AND_DIR:
                fsync_dir(sub)
        except OSError as exc:
            self._write_failed(block_hash, size, exc)
            return False
        with self._lock:
            del self._writing[block_hash]
            self._reserved -= size
            self._lru[block_hash] = size
            self._touch(block_hash)  # stamps follow the order blocks enter the index
            self._num_bytes += size
            self._counters.bytes_in += size
            self._event_stored(block_hash)
        return True

    def _write_failed(self, block_hash: bytes, size: int, exc: OSError) -> None:
        with self._lock:
            del self._writing[block_hash]
            self._reserved -= size
            self._counters.errors += 1
            self._counters.dropped_writes += 1
            if exc.errno in DISK_FULL_ERRNOS:
                if self._disabled_until is None:
                    logger.warning(
                        "disk tier %s: %s; writes disabled for %.0f s, reads go on",
                        self.root,
                        os.strerror(exc.errno or 0),
                        self.write_backoff_s,
                    )
                self._disabled_until = self._clock() + self.write_backoff_s
            else:
                logger.warning("disk tier: writing block %s failed: %s", block_hash.hex(), exc)

    def delete(self, block_hash: bytes) -> bool:
        with self._lock:
            size = self._lru.pop(block_hash, None)
            if size is None:
                return False
            self._num_bytes -= size
            unlink_quietly(self.path_of(block_hash))
            self._event_removed(block_hash)
            return True

    def close(self) -> None:
        """Release the folder lock (the files stay: that is the point of a disk tier)."""
        with self._lock:
            fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)

    # ------------------------------------------------------------------ reporting
    def check_invariants(self) -> None:
        with self._lock:
            total = sum(self._lru.values())
            if total != self._num_bytes:
                raise InvariantViolation(f"I1: num_bytes {self._num_bytes} != sum {total}")
            if self._num_bytes + self._reserved > self.capacity_bytes:
                raise InvariantViolation(
                    f"I2: {self._num_bytes} + {self._reserved} reserved bytes > capacity "
                    f"{self.capacity_bytes}"
                )
            for h, size in self._lru.items():
                try:
                    real = os.stat(self.path_of(h)).st_size
                except FileNotFoundError:
                    raise InvariantViolation(f"I3: block {h.hex()} has no file") from None
                if real != size:
                    raise InvariantViolation(f"I3: block {h.hex()} file is {real} B, index {size}")
            for sub in self.root.iterdir():
                if not sub.is_dir() or len(sub.name) != 2:
                    continue
                for f in sub.iterdir():
                    if f.name.endswith(self._suffix):
                        h = bytes.fromhex(f.name[: -len(self._suffix)])
                        if h not in self._lru and h not in self._writing:
                            raise InvariantViolation(f"I4: file {f} is not indexed")
            both = self._lru.keys() & self._writing.keys()
            if both:
                raise InvariantViolation(f"I5: {len(both)} blocks are indexed and being written")
