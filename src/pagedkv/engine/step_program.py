"""Recorded native kernel calls replayed by one ctypes call (``csrc/step_program.c``).

A decode step's layers call the kernels of ``csrc`` ~10 times a layer, each call a ctypes call
with Python around it (~1-2 µs). Their arguments stay the same from step to step but for a few
words (the attention's block tables, a new output buffer). A :class:`StepProgram` holds such
calls in segments and runs a segment with one ctypes call; its words can be patched between
runs. The kernels, their order and their arguments are those the Python calls would have
used, so the bits are the same.

A call is recorded as a :class:`Recorded`: the kernel's symbol (which picks the C prototype it
is called through: ``KINDS``), its address, and its integer/pointer and float arguments in
order; :func:`record` builds one from a ctypes function object and the ctypes arguments a
Python call would pass.
"""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from pagedkv.engine import native
from pagedkv.errors import InvalidRequestError

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

_SOURCE = Path(__file__).with_name("csrc") / "step_program.c"
# the C prototype each kernel is called through (csrc/step_program.c's PK_*)
KINDS = {
    "pagedkv_q8_linear_f32_par": 1,
    "pagedkv_bf16dot_linear": 2,
    "pagedkv_bf16dot_linear_gated": 3,
    "pagedkv_bf16_tiled": 4,
    "pagedkv_bf16_tiled_par": 5,
    "pagedkv_ggml_qlinear": 6,
    "pagedkv_ggml_qlinear_par": 7,
    "pagedkv_qlinear_i8": 8,
    "pagedkv_qlinear_i8_par": 9,
    "pagedkv_rms_norm_f32": 10,
    "pagedkv_add_rms_norm_f32": 11,
    "pagedkv_rope_write_f32": 12,
    "pagedkv_rope_write_bf16kv": 13,
    "pagedkv_decode_f32": 14,
    "pagedkv_decode_bf16kv": 15,
    "pagedkv_decode_f32_par": 16,
    "pagedkv_decode_bf16kv_par": 17,
    "pagedkv_decode_amx": 17,  # prompt_attention.c: pagedkv_decode_bf16kv_par's prototype
    "pagedkv_silu_f32": 18,
    "pagedkv_bf16dot_mlp": 19,
}
MAX_WORDS = 16  # integer/pointer arguments of any kind, at most
_FLOAT_TYPES = (ctypes.c_float, ctypes.c_double)


class _Call(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int64),
        ("fn", ctypes.c_void_p),
        ("w", ctypes.c_void_p),
        ("f", ctypes.c_void_p),
    ]


def _bind(lib: ctypes.CDLL) -> dict[int, tuple[int, int]]:
    """The signatures, and each kind's (words, floats) arity as the C side declares it."""
    i64p = ctypes.POINTER(ctypes.c_int64)
    lib.pagedkv_run_program.argtypes = [ctypes.c_void_p, ctypes.c_int64, i64p]
    lib.pagedkv_run_program.restype = ctypes.c_int
    lib.pagedkv_program_arity.argtypes = [ctypes.c_int64, i64p, i64p]
    lib.pagedkv_program_arity.restype = ctypes.c_int
    arity = {}
    for kind in KINDS.values():
        words, floats = ctypes.c_int64(), ctypes.c_int64()
        if lib.pagedkv_program_arity(kind, ctypes.byref(words), ctypes.byref(floats)):
            raise OSError(f"the step program does not know kind {kind}")
        arity[kind] = (words.value, floats.value)
    return arity


_LIB = native.LazyLibrary(_SOURCE, _bind, "native step program", "the layer loop stays in Python")


def available() -> bool:
    return _LIB.load() is not None


class Recorded(NamedTuple):
    """One kernel call: ``symbol`` (a key of ``KINDS``) at ``address`` with ``words`` (the
    integer and pointer arguments, NULL as 0) and ``floats``, each in the C order."""

    symbol: str
    address: int
    words: tuple[int, ...]
    floats: tuple[float, ...]


def record(fn: CFuncPtr, args: Sequence[object]) -> Recorded | None:
    """The call ``fn(*args)`` (``fn`` a function of a loaded library, ``args`` the ctypes
    objects or None a Python call passes), or None when its symbol has no kind here."""
    symbol = getattr(fn, "__name__", "")
    if symbol not in KINDS:
        return None
    words: list[int] = []
    floats: list[float] = []
    for a in args:
        if a is None:
            words.append(0)
        elif isinstance(a, _FLOAT_TYPES):
            floats.append(float(a.value))
        elif isinstance(a, ctypes.c_void_p | ctypes.c_int64 | ctypes.c_int | ctypes.c_int32):
            words.append(int(a.value or 0))
        elif isinstance(a, int):
            words.append(a)
        else:
            return None
    address = ctypes.cast(fn, ctypes.c_void_p).value
    return Recorded(symbol, int(address or 0), tuple(words), tuple(floats))


class StepProgram:
    """Segments of recorded calls (``segments[s]`` runs with ``run(s)``), their words in one
    array (``words[i]`` is call ``i``'s, in the order the calls run) that ``patch`` edits.

    Invariants: every call's words and floats have its kind's arity (checked here against
    the C side's table); the kernels' libraries and every buffer a word points into are kept
    alive by the caller for as long as this program runs (it holds addresses only)."""

    def __init__(self, segments: Sequence[Sequence[Recorded]]) -> None:
        lib = _LIB.load()
        if lib is None or _LIB.bound is None:
            raise InvalidRequestError(f"the native step program is unavailable: {_LIB.error}")
        calls = [c for seg in segments for c in seg]
        self.symbols = [c.symbol for c in calls]
        self.words = np.zeros((len(calls), MAX_WORDS), dtype=np.int64)
        self._floats = np.zeros((len(calls), 2), dtype=np.float32)
        self._table = (_Call * max(1, len(calls)))()
        for i, c in enumerate(calls):
            kind = KINDS[c.symbol]
            if _LIB.bound[kind] != (len(c.words), len(c.floats)):
                raise InvalidRequestError(
                    f"step program: {c.symbol} recorded with {len(c.words)} words and "
                    f"{len(c.floats)} floats; its prototype takes {_LIB.bound[kind]}"
                )
            self.words[i, : len(c.words)] = c.words
            self._floats[i, : len(c.floats)] = c.floats
            self._table[i] = _Call(
                kind, c.address, self.words[i].ctypes.data, self._floats[i].ctypes.data
            )
        base, size = ctypes.addressof(self._table), ctypes.sizeof(_Call)
        starts = np.cumsum([0, *(len(s) for s in segments)])
        self._segments = [
            (ctypes.c_void_p(base + int(a) * size), ctypes.c_int64(int(b - a)), int(a))
            for a, b in itertools.pairwise(starts)
        ]
        self._failed = ctypes.c_int64(-1)
        self._failed_ref = ctypes.byref(self._failed)
        self._run = lib.pagedkv_run_program

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    def run(self, segment: int) -> int:
        """Run segment ``segment``'s calls in order. Returns -1, or the index (into
        ``words``) of the call that returned non-zero; the calls after it were not made."""
        table, count, first = self._segments[segment]
        if self._run(table, count, self._failed_ref):
            return first + self._failed.value
        return -1
