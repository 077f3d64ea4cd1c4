"""A model's native layer ops (``layer_ops``) across steps: its norm weights checked once
(:class:`ModelLayerOps`) and one step's buffers and prebuilt ctypes arguments
(:class:`StepBuffers`), kept for the next step of the same size so a decode step's layers call
the kernels with nothing converted or allocated per call.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from pagedkv.engine import layer_ops
from pagedkv.engine.kv_cache import PagedKVCache
from pagedkv.errors import InvalidRequestError

if TYPE_CHECKING:
    from _ctypes import CFuncPtr

QKNorm = tuple[torch.Tensor, torch.Tensor]  # per-head q and k RMSNorm weights (Qwen3)
_MAX_KEPT_ROWS = 64  # ModelLayerOps keeps the buffers of steps up to this many tokens ...
_MAX_KEPT = 8  # ... for this many row counts (the oldest is dropped first)
_V, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
KV_DTYPES = (torch.float32, torch.bfloat16)  # the caches rope_write writes (bf16: rounded)


def _raw(lib: ctypes.CDLL, name: str) -> CFuncPtr:
    """The symbol as a second function object without ``argtypes``: called with ctypes
    objects built once (``StepBuffers``), it converts nothing per call. Every argument passed
    to it must be a ctypes object of the C parameter's type, or None for a NULL pointer."""
    fn = lib[name]
    fn.restype = ctypes.c_int
    return fn


class ModelLayerOps:
    """A model's norm weights for the native layer ops, checked once at load (contiguous
    float32, ``[hidden]`` and ``[head_dim]``); ``step`` hands out one step's buffers, kept
    for the next step of the same size. Raises InvalidRequestError when the kernels are
    unavailable or a weight does not fit (the model then keeps the torch ops)."""

    def __init__(
        self,
        input_norms: Sequence[torch.Tensor],
        post_norms: Sequence[torch.Tensor],
        final_norm: torch.Tensor,
        qk_norms: Sequence[QKNorm] | None,
        eps: float,
        head_dim: int,
    ) -> None:
        self.lib = layer_ops.library()
        hidden = final_norm.shape[0]
        layer_ops.check_tensors((*input_norms, *post_norms, final_norm))
        if qk_norms is not None:
            layer_ops.check_tensors(tuple(t for pair in qk_norms for t in pair))
        if (
            not layer_ops.supports(hidden, head_dim)
            or any(w.shape != (hidden,) for w in (*input_norms, *post_norms, final_norm))
            or any(w.shape != (head_dim,) for pair in qk_norms or () for w in pair)
        ):
            raise InvalidRequestError(
                f"native layer ops: norm weights do not fit hidden {hidden} / head_dim {head_dim}"
            )
        self.weights = (input_norms, post_norms, final_norm, qk_norms)  # kept alive
        self.input_ptrs = [w.data_ptr() for w in input_norms]
        # the norm after layer i's MLP: layer i + 1's input norm, or the final norm
        self.next_ptrs = [*self.input_ptrs[1:], final_norm.data_ptr()]
        self.post_ptrs = [w.data_ptr() for w in post_norms]
        self.qk_ptrs = [(q.data_ptr(), k.data_ptr()) for q, k in qk_norms or ()]
        self.eps, self.hidden, self.head_dim = eps, hidden, head_dim
        self.raw_norm = _raw(self.lib, "pagedkv_rms_norm_f32")
        self.raw_add_norm = _raw(self.lib, "pagedkv_add_rms_norm_f32")
        self.raw_rope = _raw(self.lib, "pagedkv_rope_write_f32")
        self.raw_rope_bf16kv = _raw(self.lib, "pagedkv_rope_write_bf16kv")  # a bf16 KV cache
        self._kept: dict[int, StepBuffers] = {}  # rows -> the last step's buffers

    @staticmethod
    def keeps(num_tokens: int) -> bool:
        """Whether ``step`` keeps the buffers of a step of ``num_tokens`` tokens."""
        return num_tokens <= _MAX_KEPT_ROWS

    def step(
        self, num_tokens: int, cache: PagedKVCache, num_heads: int, intermediate_size: int
    ) -> StepBuffers:
        """Buffers for a step of ``num_tokens`` tokens over ``cache``: those of the last step
        of this size when they were built for this cache as it is now (its tensors change
        only when it grows), else new ones (kept when the step is small)."""
        buf = self._kept.get(num_tokens)
        if buf is not None and buf.fits(cache, num_heads, intermediate_size):
            return buf
        buf = StepBuffers(self, num_tokens, cache, num_heads, intermediate_size)
        if num_tokens <= _MAX_KEPT_ROWS:
            self._kept.pop(num_tokens, None)
            if len(self._kept) >= _MAX_KEPT:
                del self._kept[next(iter(self._kept))]
            self._kept[num_tokens] = buf
        return buf


class StepBuffers:
    """A step's buffers for the native layer ops, with every native call's arguments built
    once as ctypes objects, so that each per-layer call converts nothing. ``h``
    (``[tokens, hidden]``) is the residual stream, updated in place; ``x`` holds each norm's
    output and ``out`` the final norm's; ``qkv``, ``q``, ``att``, ``o``, ``gate_up``,
    ``act`` and ``down`` are the projections' and attention's outputs; ``cos``/``sin``/
    ``slots`` the step's RoPE rows and K/V slots (``load`` fills them).

    Invariants: every buffer is contiguous float32 (``slots`` int64) on the CPU with this
    step's shapes (the cache's pools are float32, or bfloat16: K/V rounded as torch
    casts); the prebuilt arguments point at these buffers, the norm weights and the pools of
    ``cache`` as they were when built (``fits`` says whether they still are); a projection
    output that is not the step's own buffer (a quantized layer's) is checked
    and converted on each call. ``out`` is new on every ``load``: a caller may keep it."""

    def __init__(
        self,
        ops: ModelLayerOps,
        num_tokens: int,
        cache: PagedKVCache,
        num_heads: int,
        intermediate_size: int,
    ) -> None:
        n, hd, hidden = num_tokens, ops.head_dim, ops.hidden
        nkv = cache.spec.num_kv_heads
        pools_ok = all(t.is_contiguous() and t.device.type == "cpu" for t in cache.kv)
        if not pools_ok or cache.k[0].shape[3] != hd or cache.spec.dtype not in KV_DTYPES:
            raise InvalidRequestError(
                f"native layer ops: pool {tuple(cache.k[0].shape)} {cache.spec.dtype} does "
                f"not fit head_dim {hd}"
            )
        # a weak reference: kept buffers must not keep a dropped cache (gigabytes) alive
        self.ops, self._cache = ops, weakref.ref(cache)
        self._built_for = (cache.num_grows, cache.num_blocks, num_heads, intermediate_size)
        self.h, self.x = torch.empty(n, hidden), torch.empty(n, hidden)
        self.o, self.down, self.out = torch.empty(n, hidden), torch.empty(n, hidden), self.x
        self.qkv = torch.empty(n, (num_heads + 2 * nkv) * hd)
        self.q, self.att = torch.empty(n, num_heads, hd), torch.empty(n, num_heads, hd)
        self.att_rows = self.att.view(n, num_heads * hd)
        self.gate_up = torch.empty(n, 2 * intermediate_size)
        self.gate = self.gate_up[:, :intermediate_size]
        self.up = self.gate_up[:, intermediate_size:]
        self.act = torch.empty(n, intermediate_size)
        self.cos, self.sin = torch.empty(n, hd), torch.empty(n, hd)
        self.slots = torch.empty(n, dtype=torch.int64)
        self._qkv_shape = (n, (num_heads + 2 * nkv) * hd)
        self._dims = (n, num_heads, nkv, hd, cache.num_slots)
        self._h, self._x = self.h.data_ptr(), self.x.data_ptr()
        self._vw = layer_ops.vector_width()
        rows, width, eps, vw = _I(n), _I(hidden), _F(ops.eps), _I(layer_ops.vector_width())
        h, x = _V(self._h), _V(self._x)
        self._norm0 = (h, width, _V(ops.input_ptrs[0]), x, rows, width, eps, vw)
        o, down = _V(self.o.data_ptr()), _V(self.down.data_ptr())
        self._post = [(h, o, width, _V(w), x, rows, width, eps, vw) for w in ops.post_ptrs]
        self._next = [(h, down, width, _V(w), x, rows, width, eps, vw) for w in ops.next_ptrs]
        shared = [_V(t.data_ptr()) for t in (self.qkv, self.cos, self.sin, self.slots, self.q)]
        dims = tuple(_I(d) for d in self._dims)
        qk: list[tuple[ctypes.c_void_p | None, ...]] = [(_V(a), _V(b)) for a, b in ops.qk_ptrs]
        qk = qk or [(None, None)] * len(ops.post_ptrs)  # NULL: no q/k norms
        self._rope = [
            (*shared, _V(k.data_ptr()), _V(v.data_ptr()), *dims, *qk[i], eps, vw)
            for i, (k, v) in enumerate(zip(cache.k, cache.v, strict=True))
        ]
        self._final = self._next[-1]  # into out (load gives each step its own)
        bf16_cache = cache.spec.dtype is torch.bfloat16
        self._raw_rope = ops.raw_rope_bf16kv if bf16_cache else ops.raw_rope

    # The prebuilt calls, for a step program (models.layer_program): each is
    # ``fn(*args)`` of the method named.
    @property
    def num_slots(self) -> int:
        return self._dims[-1]

    @property
    def norm0_args(self) -> tuple[object, ...]:
        return self._norm0  # input_norm: ops.raw_norm

    @property
    def post_args(self) -> Sequence[tuple[object, ...]]:
        return self._post  # add_post_norm(layer, self.o): ops.raw_add_norm

    def next_args(self, layer: int) -> tuple[object, ...]:
        """add_next_norm(layer, self.down)'s: ops.raw_add_norm (the last layer's writes the
        ``out`` of the step that was loaded last)."""
        return self._final if layer == len(self._next) - 1 else self._next[layer]

    @property
    def rope_fn(self) -> CFuncPtr:
        return self._raw_rope  # rope_write(layer, self.qkv): rope_fn(*rope_args[layer])

    @property
    def rope_args(self) -> Sequence[tuple[object, ...]]:
        return self._rope

    def fits(self, cache: PagedKVCache, num_heads: int, intermediate_size: int) -> bool:
        """Whether these buffers serve a step over ``cache`` as it is now."""
        return cache is self._cache() and self._built_for == (
            cache.num_grows, cache.num_blocks, num_heads, intermediate_size
        )  # fmt: skip

    def load(
        self,
        input_ids: torch.Tensor,
        embed: torch.Tensor,
        cos_table: torch.Tensor,
        sin_table: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """The step's inputs: ``h`` = the embedding rows of ``input_ids`` (as float32),
        ``cos``/``sin``
        = the tables' rows at ``positions``, ``slots`` = the K/V slots (``[tokens]``
        int64 each); and a new ``out`` for the final norm."""
        n = self.h.shape[0]
        if input_ids.shape != (n,) or positions.shape != (n,) or slots.shape != (n,):
            raise InvalidRequestError(
                f"native layer ops: ids{tuple(input_ids.shape)} positions"
                f"{tuple(positions.shape)} slots{tuple(slots.shape)} for a {n}-token step"
            )
        if embed.dtype is torch.float32:
            torch.index_select(embed, 0, input_ids, out=self.h)
        else:  # bf16 weights (models.llama): the rows widen exactly
            self.h.copy_(embed.index_select(0, input_ids))
        torch.index_select(cos_table, 0, positions, out=self.cos)
        torch.index_select(sin_table, 0, positions, out=self.sin)
        self.slots.copy_(slots)
        self.out = torch.empty_like(self.x)
        last = self._next[-1]
        self._final = (*last[:4], _V(self.out.data_ptr()), *last[5:])

    def input_norm(self) -> None:
        """``x = norm(h)`` with layer 0's input norm."""
        self.ops.raw_norm(*self._norm0)

    def _delta_args(self, delta: torch.Tensor, weight: int, out: int) -> tuple[object, ...]:
        layer_ops.check_tensors((delta,))
        if delta.shape != self.h.shape:
            raise InvalidRequestError(f"a residual of shape {tuple(delta.shape)}")
        n, hidden = self.h.shape
        return (_V(self._h), _V(delta.data_ptr()), _I(hidden), _V(weight), _V(out), _I(n),
                _I(hidden), _F(self.ops.eps), _I(self._vw))  # fmt: skip

    def add_post_norm(self, layer: int, delta: torch.Tensor) -> None:
        """``h += delta`` (the attention output) and ``x = post_attention_norm(h)``."""
        if delta is self.o:
            self.ops.raw_add_norm(*self._post[layer])
        else:
            self.ops.raw_add_norm(*self._delta_args(delta, self.ops.post_ptrs[layer], self._x))

    def add_next_norm(self, layer: int, delta: torch.Tensor) -> None:
        """``h += delta`` (the MLP output) and ``x`` = the next layer's input norm of ``h``;
        after the last layer, ``out`` = the final norm of ``h``."""
        last = layer == len(self._next) - 1
        if delta is self.down:
            self.ops.raw_add_norm(*(self._final if last else self._next[layer]))
        else:
            out = self.out.data_ptr() if last else self._x
            self.ops.raw_add_norm(*self._delta_args(delta, self.ops.next_ptrs[layer], out))

    def rope_write(self, layer: int, qkv: torch.Tensor) -> None:
        """RoPE (after the per-head norms when the model has them) on ``qkv``'s q and k,
        q into ``self.q``, k and v into layer ``layer``'s pools at the step's slots (rounded
        to nearest even for a bf16 cache, as ``PagedKVCache.write``'s cast)."""
        if qkv is self.qkv:
            code = self._raw_rope(*self._rope[layer])
        else:
            layer_ops.check_tensors((qkv,))
            if qkv.shape != self._qkv_shape:
                raise InvalidRequestError(f"a qkv projection of shape {tuple(qkv.shape)}")
            code = self._raw_rope(_V(qkv.data_ptr()), *self._rope[layer][1:])
        if code:
            raise InvalidRequestError(
                f"rope_write: a slot is outside [0, {self._dims[-1]}) (the cache's slots)"
            )
