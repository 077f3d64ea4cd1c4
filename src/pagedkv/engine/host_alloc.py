"""Keep large step temporaries in the process heap (glibc ``mallopt``), so steps don't page-fault.

Every torch op on the CPU allocates its output with ``malloc``. glibc serves blocks above its
mmap threshold (128 KiB at start, raised on the fly up to 32 MiB) with a fresh ``mmap`` and
returns the heap top to the OS once 2x that threshold is free there, so a prefill step's
multi-megabyte activations are faulted in page by page at every step: ~16,000 minor page faults
for a 2,048-token step of the engine benchmark's model, which took 205-217 ms instead of 184 ms
(benchmarks/RESULTS.md, engine section). Raising both thresholds keeps freed activations in the
heap for the next step: the cost is that up to ``trim_threshold`` bytes of freed memory stay
mapped to the process.

This is a process-wide setting (every thread and library in the process shares glibc's
allocator), which is why the engine applies it only on the CPU and only when ``EngineConfig``
asks (the default); it is applied once per process. Other C libraries (musl, macOS) are left
alone: ``tune_host_allocator`` then returns False.

Huge pages (``reexec_with_huge_pages``). A decode step streams every weight and much of the
KV cache, and with 4 KiB pages that is a page-table walk every 4 KiB. glibc >= 2.35 asks the
kernel for transparent huge pages (2 MiB) on all the memory ``malloc`` takes when the
process starts with ``GLIBC_TUNABLES=glibc.malloc.hugetlb=1`` (the kernel must allow them:
THP ``madvise`` or ``always``); tunables are read once, at start, so the ``pagedkv`` commands
that run a model re-execute themselves with it (the same PID and arguments; opt out with
``PAGEDKV_HUGE_PAGES=0``). Measured on SmolLM2-135M, bf16 ``medium``, the 2-core Xeon
(benchmarks/RESULTS.md, session 20): a 16-request decode step ~7% faster at 2 threads in
every alternating pair, a 1,024-token prefill 2-6% at 1 thread, peak RSS within 2%
(2.57 vs 2.59 GB for a decode run, 1.38 vs 1.35 GB for an idle server). Putting only
the weights, or only the KV cache, in huge pages gave 0-2%.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
# Blocks up to 64 MiB come from the heap (glibc versions that cap the threshold at 32 MiB get
# that); the heap top is returned to the OS once 256 MiB of it is free.
MMAP_THRESHOLDS = (64 << 20, 32 << 20)
TRIM_THRESHOLD = 256 << 20

_lock = threading.Lock()
_applied: bool | None = None  # None: not tried yet


def tune_host_allocator() -> bool:
    """Raise glibc's mmap and trim thresholds (see the module docstring), once per process;
    returns whether they are in effect (False off glibc or when ``mallopt`` refuses)."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    for threshold in MMAP_THRESHOLDS:
        if mallopt(_M_MMAP_THRESHOLD, threshold) == 1:
            break
    else:
        return False
    if mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return False
    logger.debug("glibc malloc: mmap threshold %d, trim threshold %d", threshold, TRIM_THRESHOLD)
    return True


HUGE_PAGE_TUNABLE = "glibc.malloc.hugetlb=1"
_OFF = frozenset({"0", "false", "no", "off"})  # PAGEDKV_HUGE_PAGES values that opt out
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _glibc_at_least(major: int, minor: int) -> bool:
    try:
        name, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").split()  # "glibc 2.36"
        got = tuple(int(part) for part in version.split(".")[:2])
    except (AttributeError, OSError, ValueError):  # not glibc
        return False
    return name == "glibc" and got >= (major, minor)


def _thp_allowed() -> bool:
    """Whether the kernel grants transparent huge pages to a process that asks."""
    try:
        mode = _THP_MODE.read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


def huge_page_env(env: Mapping[str, str]) -> dict[str, str] | None:
    """``env`` with glibc's huge-page tunable added (after any tunables already there), or
    None where it would change nothing or is not wanted: already set, opted out
    (``PAGEDKV_HUGE_PAGES`` 0, false, no or off), not Linux, glibc older than 2.35, or THP off."""
    tunables = env.get("GLIBC_TUNABLES", "")
    if (
        HUGE_PAGE_TUNABLE.split("=")[0] in tunables
        or env.get("PAGEDKV_HUGE_PAGES", "1").strip().lower() in _OFF
        or not sys.platform.startswith("linux")
        or not _glibc_at_least(2, 35)
        or not _thp_allowed()
    ):
        return None
    joined = f"{tunables}:{HUGE_PAGE_TUNABLE}" if tunables else HUGE_PAGE_TUNABLE
    return {**env, "GLIBC_TUNABLES": joined}


def reexec_with_huge_pages() -> None:
    """Re-execute this process with ``huge_page_env`` (the module docstring): the same
    interpreter and arguments (``sys.orig_argv``), the same PID. Returns only where nothing
    is to be done, or where the exec fails (logged). Call it first, before any thread starts
    or any output is written."""
    env = huge_page_env(os.environ)
    if env is None or not sys.orig_argv:
        return
    logger.debug("re-executing with GLIBC_TUNABLES=%s", env["GLIBC_TUNABLES"])
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as exc:  # the interpreter cannot be run again: go on with 4 KiB pages
        logger.warning("could not re-execute with huge pages (%s); continuing without", exc)
