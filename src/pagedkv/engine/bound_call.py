"""A native kernel call with every argument converted once (:class:`BoundKernel`).

A ctypes call through a function with ``argtypes`` converts each Python int on every call
(~2 µs for a 12-argument kernel here); a batch-1 decode step makes ~120 linear-layer calls
whose arguments (buffer pointers, shapes, the thread split) are the same from one step to the
next. A ``BoundKernel`` converts them once, to the C parameters' ctypes types, and calls a
second, ``argtypes``-free function object of the same symbol with them (as
``layer_op_buffers`` does for the layer ops).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pagedkv.engine import native, step_program
from pagedkv.errors import InvalidRequestError

if TYPE_CHECKING:
    from _ctypes import CFuncPtr


class BoundKernel:
    """``symbol(*part)`` for each part (the first on this thread, the others on
    :func:`native.workers`), returning ``out``.

    Invariants: every part has one value per C parameter of ``symbol`` (``argtypes`` of the
    typed function in ``lib``, which must be set), converted to that type once here; the
    tensors the pointers point into are held in ``keep`` for as long as this call lives, so
    a pointer never outlives its memory. Raises ``InvalidRequestError`` naming ``kernel`` when
    any part returns non-zero."""

    __slots__ = ("_args", "_fn", "_keep", "_kernel", "out")

    def __init__(
        self,
        lib: ctypes.CDLL,
        symbol: str,
        parts: Sequence[Sequence[int | float | None]],
        out: torch.Tensor,
        keep: tuple[object, ...],
        kernel: str,
    ) -> None:
        fn, types = _raw(lib, symbol)
        if not parts or types is None or any(len(p) != len(types) for p in parts):
            raise InvalidRequestError(f"{kernel}: {len(parts)} argument sets for {symbol}")
        self._args = [tuple(t(v) for t, v in zip(types, p, strict=True)) for p in parts]
        self._fn, self.out, self._keep, self._kernel = fn, out, keep, kernel

    def __call__(self) -> torch.Tensor:
        fn, args = self._fn, self._args
        if len(args) == 1:
            failed = fn(*args[0]) != 0
        else:
            pool = native.workers(len(args) - 1)
            futures = [pool.submit(fn, *a) for a in args[1:]]
            codes = [fn(*args[0]), *(f.result() for f in futures)]  # wait for every part
            failed = any(codes)
        if failed:
            raise InvalidRequestError(self.failure())
        return self.out

    def failure(self) -> str:
        """The message a failed call raises."""
        return f"{self._kernel} rejected its inputs (a bad range)"

    def recorded(self) -> step_program.Recorded | None:
        """This call for a :class:`step_program.StepProgram` (the same kernel and arguments),
        or None when it has more than one part (a thread split on Python workers)."""
        if len(self._args) != 1:
            return None
        return step_program.record(self._fn, self._args[0])


@functools.cache
def _raw(lib: ctypes.CDLL, symbol: str) -> tuple[CFuncPtr, Sequence[type] | None]:
    """``symbol`` as a second function object without ``argtypes`` (so a call converts
    nothing), and the typed function's ``argtypes``; one per library and symbol."""
    fn = lib[symbol]
    fn.restype = ctypes.c_int
    return fn, getattr(lib, symbol).argtypes


def fits(x: torch.Tensor, out: torch.Tensor, in_dim: int, out_dim: int, max_rows: int) -> bool:
    """Whether ``x`` (``[rows <= max_rows, in_dim]``) and ``out`` (``[rows, out_dim]``) are
    contiguous float32 CPU buffers a row-major kernel can read and write as they are."""
    return (
        x.dtype is torch.float32
        and out.dtype is torch.float32
        and x.is_cpu
        and out.is_cpu
        and x.dim() == 2
        and x.shape[0] <= max_rows
        and x.shape[1] == in_dim
        and out.shape == (x.shape[0], out_dim)
        and x.is_contiguous()
        and out.is_contiguous()
    )
