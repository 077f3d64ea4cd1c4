"""The disk tier's files: names, the atomic writer, fsync policies and the start-up scan.

Layout under the tier's folder (created 0700; files 0600)::

    root/ab/ab12...ef.<tag>.kvb              a block: hex hash, layout tag, the encoded payload
    root/ab/.ab12...ef.<tag>.<pid>.<n>.tmp   a write in progress (removed at start if left over)

``<tag>`` is :attr:`TierLayout.tag`, so files of another model or layout are recognised by name
alone and never read, deleted or counted against this tier's budget. The scan needs one
``stat`` per file and no reads.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from pagedkv.errors import TierUnavailableError

FileWriter = Callable[[str, bytes, bool], None]
"""``writer(path, data, fsync)``: create ``path`` (0600, must not exist), write all of ``data``,
fsync it if asked. Injectable so tests can simulate a full disk."""

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})
"""Write errors that disable writes for a back-off period (retrying at once would fail too)."""

BLOCK_SUFFIX = ".kvb"


class FsyncPolicy(Enum):
    """How hard a finished write is pushed to stable storage."""

    NONE = "none"  # rely on the checksum: a write lost in a crash reads as a miss
    FILE = "file"  # fsync the file before the rename
    FILE_AND_DIR = "file+dir"  # also fsync the folder after the rename (the name is durable)


def write_file(path: str, data: bytes, fsync: bool) -> None:
    """The default :data:`FileWriter`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(path: str) -> None:
    """Remove a file; a file already gone is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def open_root(root: Path) -> int:
    """Create the tier's folder (0700) if needed; return its permission bits."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise TierUnavailableError(f"cannot create disk tier folder {root}: {exc}") from exc
    if not root.is_dir():
        raise TierUnavailableError(f"disk tier path {root} is not a folder")
    return root.stat().st_mode & 0o777


def lock_folder(root: Path, tag: str) -> int:
    """Take the exclusive lock of one layout in ``root``; return its file descriptor (closing it
    releases the lock). Raises TierUnavailableError when another DiskTier holds it."""
    path = root / f".lock.{tag}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        raise TierUnavailableError(
            f"disk tier folder {root} is in use by another DiskTier for this layout ({path} is "
            "locked); give each engine its own folder"
        ) from exc
    return fd


@dataclass(slots=True)
class ScanResult:
    """What a start-up scan found for one layout tag."""

    entries: list[tuple[int, bytes, int]] = field(default_factory=list)  # (mtime ns, hash, size)
    subdirs: set[str] = field(default_factory=set)
    num_foreign_files: int = 0  # block files of other layouts (left alone)
    num_temp_files_removed: int = 0  # this layout's leftover temp files (deleted)


def _scan_subdir(sub: str, tmp_mark: str, suffix: str) -> ScanResult:
    out = ScanResult()
    slen = len(suffix)
    entries = out.entries
    with os.scandir(sub) as it:
        for e in it:
            name = e.name
            if name.endswith(suffix):
                try:
                    block_hash = bytes.fromhex(name[:-slen])
                    st = e.stat(follow_symlinks=False)
                except (ValueError, FileNotFoundError):  # not our name, or gone meanwhile
                    continue
                if block_hash:
                    entries.append((st.st_mtime_ns, block_hash, st.st_size))
            elif name.endswith(".tmp"):
                if tmp_mark in name:
                    unlink_quietly(e.path)
                    out.num_temp_files_removed += 1
            elif name.endswith(BLOCK_SUFFIX):
                out.num_foreign_files += 1
    return out


def scan(root: Path, tag: str, num_threads: int = 4) -> ScanResult:
    """Find this layout's block files under ``root``, least recently used first, and delete its
    leftover temp files. Files that vanish during the scan are skipped. Subfolders are scanned
    by ``num_threads`` threads (``stat`` releases the GIL)."""
    tmp_mark = f".{tag}."
    suffix = f".{tag}{BLOCK_SUFFIX}"
    with os.scandir(root) as top:
        subs = [e.path for e in top if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    out = ScanResult(subdirs=set(subs))
    with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
        for part in pool.map(lambda sub: _scan_subdir(sub, tmp_mark, suffix), subs):
            out.entries.extend(part.entries)
            out.num_foreign_files += part.num_foreign_files
            out.num_temp_files_removed += part.num_temp_files_removed
    out.entries.sort()
    return out
