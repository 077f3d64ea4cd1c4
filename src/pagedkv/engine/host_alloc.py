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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys
import threading

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
