"""Building and loading pagedkv's C kernels (``csrc/*.c``): the per-user build cache and the
build-once :class:`LazyLibrary` every kernel module loads through.

A kernel is compiled with the system C compiler (``$CC``, else ``cc``/``gcc``) into a per-user
cache (``$PAGEDKV_CACHE_DIR`` or ``~/.cache/pagedkv``), keyed by the source, the flags, the
compiler and the CPU (the source's bytes include the ``csrc/*.h`` headers beside it), so a copy
built for another machine, or from other headers, is never loaded. Without a compiler,
or when the build (or a module's load-time check) fails, the library is unavailable: the reason
is logged once and the caller keeps its torch/numpy path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

FlagSets = tuple[tuple[list[str], list[str]], ...]  # (compile flags, link flags), tried in order

# The default flag sets. -ffast-math lets gcc call glibc's vectorised expf (libmvec); the
# kernels built with it never make infinities. It is a compile flag only: linking a shared
# object with -ffast-math pulls in crtfastmath.o, which turns on flush-to-zero for the whole
# process (every denormal float in torch and Python would become 0).
FLAG_SETS: FlagSets = (
    (["-O3", "-march=native", "-ffast-math", "-fPIC"], ["-shared", "-lm", "-lmvec"]),
    (["-O3", "-ffast-math", "-fPIC"], ["-shared", "-lm"]),  # no libmvec, or no -march=native
)


def with_openmp(flag_sets: FlagSets) -> FlagSets:
    """``flag_sets`` built with OpenMP first, then as they are: a kernel's ``_par`` entry points
    then run their parts on the process's OpenMP runtime, torch's (loaded first; the dynamic
    linker reuses a loaded ``libgomp.so.1`` by soname), and a compiler without libgomp falls
    back to the plain sets."""
    return tuple(([*c, "-fopenmp"], [*ln, "-fopenmp"]) for c, ln in flag_sets) + flag_sets


T = TypeVar("T")


def _cpu_key() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> Path:
    root = os.environ.get("PAGEDKV_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "pagedkv"


def _first_error(stderr: str, program: str) -> str:
    """The compiler's first ``error`` line (its last line is often a caret under the source)."""
    lines = stderr.strip().splitlines()
    for line in lines:
        if "error" in line:
            return line.strip()
    return lines[-1].strip() if lines else f"{program} failed"


def compile_library(source_path: Path, flag_sets: FlagSets = FLAG_SETS) -> ctypes.CDLL:
    """Compile one C file of ``csrc`` into the per-user cache (the module docstring: keyed by
    the source, flags, compiler and CPU) and load it, with the first of ``flag_sets`` that
    builds (default: -O3 -march=native -ffast-math). Raises OSError naming why it failed."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler (set CC, or install gcc)")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    # the headers next to the source (shared helpers it may include) are part of its key
    headers = [h.read_bytes() for h in sorted(source_path.parent.glob("*.h"))]
    source = b"\0".join([source_path.read_bytes(), *headers])
    stem = source_path.stem
    errors = []
    for cflags, ldflags in flag_sets:
        flags = " ".join([*cflags, "|", *ldflags]).encode()
        key = hashlib.sha256(
            b"\0".join([source, flags, version.encode(), _cpu_key().encode()])
        ).hexdigest()[:16]
        target = _cache_dir() / "native" / key / f"{stem}.so"
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                obj, built = Path(tmp) / f"{stem}.o", Path(tmp) / f"{stem}.so"
                for cmd in (
                    [compiler, *cflags, "-c", str(source_path), "-o", str(obj)],
                    [compiler, str(obj), "-o", str(built), *ldflags],
                ):
                    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
                    if proc.returncode != 0:
                        errors.append(_first_error(proc.stderr, cmd[0]))
                        break
                else:  # atomic: a concurrent build of the same key is harmless
                    os.replace(built, target)
            if not target.is_file():
                continue
        return ctypes.CDLL(str(target))
    raise OSError("; ".join(errors))


class LazyLibrary(Generic[T]):
    """One C file of ``csrc``, built and loaded on the first :meth:`load` (thread-safe), at most
    once per process, with ``flag_sets`` (default :data:`FLAG_SETS`). ``bind`` then sets the
    ctypes signatures and may check the library (raising OSError to refuse it); what it
    returns is kept as ``bound`` (e.g. a vector width the check found). A failed build or check
    is remembered with its reason (``error``) and never retried: the caller falls back to its
    torch/numpy path, and one warning says so.
    Invariant: at most one of ``lib`` and ``error`` is set, neither changes once set, and
    ``bound`` is ``bind``'s result exactly when ``lib`` is set."""

    def __init__(
        self,
        source: Path,
        bind: Callable[[ctypes.CDLL], T],
        what: str,
        fallback: str,
        flag_sets: FlagSets = FLAG_SETS,
    ) -> None:
        self._source, self._bind, self._flag_sets = source, bind, flag_sets
        self._what, self._fallback = what, fallback  # for the warning
        self._lock = threading.Lock()
        self.lib: ctypes.CDLL | None = None
        self.bound: T | None = None
        self.error: str | None = None

    def load(self) -> ctypes.CDLL | None:
        """The loaded library, building it on the first call; ``None`` if it cannot be built."""
        lib = self.lib
        if lib is not None:
            return lib
        with self._lock:
            if self.lib is None and self.error is None:
                try:
                    built = compile_library(self._source, self._flag_sets)
                    self.bound = self._bind(built)  # ctypes signatures, load-time checks
                    self.lib = built
                except (OSError, subprocess.SubprocessError) as exc:
                    self.error = str(exc) or type(exc).__name__
                    logger.warning(
                        "%s unavailable (%s); %s", self._what, self.error, self._fallback
                    )
        return self.lib

    def reason(self) -> str | None:
        """Why the library is unavailable (building it first if nobody has tried), or None."""
        self.load()
        return self.error
