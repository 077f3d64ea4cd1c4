"""A decoder layer's small ops as native kernels (``csrc/layer_ops.c``), bit-identical to torch.

At batch 1 a decode step's matmuls are a few large calls, but the ops between them (RMSNorm's
seven, RoPE's dozen, the K/V write's six, the residual adds) were ~50 torch calls per layer,
~1,600 per step on a 30-layer model, each a few microseconds of dispatch. Here RMSNorm (with
the residual add before it) is one call and RoPE on q and k with the K/V write into the paged
pool is another.

Exactness: every float32 result equals torch's reference formulas (``models.llama``'s
``_rms_norm`` and RoPE, transformers' LlamaRMSNorm) bit for bit. The elementwise steps are
the same IEEE operations in the same order; the sum of squares follows the order of torch's
CPU sum kernel, whose vector width depends on the CPU torch dispatches to. So ``available()``
compiles the library (no -ffast-math, no FMA contraction), then checks it against torch on
random rows of several widths for torch's vector width, and refuses it (logging why) when any
bit differs: the model then keeps the torch ops (``LlamaModel.fused_layer_ops`` is the switch).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path

import torch

from pagedkv.engine import native
from pagedkv.engine.kv_cache import PagedKVCache
from pagedkv.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "layer_ops.c"
# No -ffast-math (it reassociates sums and turns 1/sqrtf into an approximation) and no FMA
# contraction (a*b + c must round twice, as torch's separate mul and add kernels do).
_FLAG_SETS: native.FlagSets = (
    (["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC"], ["-shared"]),
    (["-O2", "-ffp-contract=off", "-fno-math-errno", "-fPIC"], ["-shared"]),
)
# torch's float vector width per CPU capability (ATen's Vectorized<float>::size())
_VECTOR_WIDTH = {"AVX512": 16, "AVX2": 8, "DEFAULT": 8}
_CHECK_WIDTHS = (8, 16, 24, 64, 100, 128, 576, 1000, 2048, 4099)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_vector_width = 0
_error: str | None = None


def _reference_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The formula the kernel reproduces (``models.llama._rms_norm`` in float32)."""
    xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf


def _load() -> tuple[ctypes.CDLL, int]:
    lib = native.compile_library(_SOURCE, _FLAG_SETS)
    ptr, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    lib.pagedkv_rms_norm_f32.argtypes = [ptr, i64, ptr, ptr, i64, i64, f32, i64]
    lib.pagedkv_add_rms_norm_f32.argtypes = [ptr, ptr, i64, ptr, ptr, i64, i64, f32, i64]
    lib.pagedkv_rope_write_f32.argtypes = [ptr] * 7 + [i64] * 5 + [ptr, ptr, f32, i64]
    for fn in (lib.pagedkv_rms_norm_f32, lib.pagedkv_add_rms_norm_f32, lib.pagedkv_rope_write_f32):
        fn.restype = ctypes.c_int
    capability = torch.backends.cpu.get_cpu_capability()
    width = _VECTOR_WIDTH.get(capability)
    if width is None:
        raise OSError(f"torch's CPU capability {capability} has no known vector width")
    gen = torch.Generator().manual_seed(0)
    for d in _CHECK_WIDTHS:
        x = torch.randn(3, d, generator=gen) * 3
        w = torch.randn(d, generator=gen)
        out = torch.empty_like(x)
        code = lib.pagedkv_rms_norm_f32(x.data_ptr(), d, w.data_ptr(), out.data_ptr(), 3, d,
                                        1e-5, width)  # fmt: skip
        if code or not torch.equal(out, _reference_norm(x, w, 1e-5)):
            raise OSError(
                f"RMSNorm of width {d} differs from torch's ({capability}, {width} lanes)"
            )
    return lib, width


def available() -> bool:
    """Whether the kernels are built, loaded and bit-identical to torch here (checked once)."""
    global _lib, _vector_width, _error
    with _lock:
        if _lib is None and _error is None:
            try:
                _lib, _vector_width = _load()
            except (OSError, subprocess.SubprocessError) as exc:
                _error = str(exc) or type(exc).__name__
                logger.warning("native layer ops unavailable (%s); using torch's", _error)
        return _lib is not None


def unavailable_reason() -> str | None:
    available()
    return _error


def supports(hidden_size: int, head_dim: int) -> bool:
    """Whether the kernels take these widths (torch's vector width or more; even head_dim)."""
    return available() and min(hidden_size, head_dim) >= _vector_width and head_dim % 2 == 0


def _check(tensors: tuple[torch.Tensor, ...]) -> None:
    for t in tensors:
        if t.dtype is not torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise InvalidRequestError(
                f"native layer ops take contiguous float32 CPU tensors; got {t.dtype} "
                f"{tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()})"
            )


def _lib_or_raise() -> ctypes.CDLL:
    if not available():
        raise InvalidRequestError(f"the native layer ops are unavailable: {_error}")
    assert _lib is not None
    return _lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    """``out = rms_norm(x)`` row by row; ``x``, ``out``: ``[rows, d]``, ``weight``: ``[d]``."""
    lib = _lib_or_raise()
    _check((x, weight, out))
    rows, d = x.shape
    if out.shape != x.shape or weight.shape != (d,):
        raise InvalidRequestError(f"rms_norm: x{tuple(x.shape)} out{tuple(out.shape)}")
    code = lib.pagedkv_rms_norm_f32(x.data_ptr(), d, weight.data_ptr(), out.data_ptr(), rows, d,
                                    eps, _vector_width)  # fmt: skip
    if code:
        raise InvalidRequestError(f"rms_norm: width {d} is below {_vector_width}")


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> None:
    """``h += delta`` then ``out = rms_norm(h)``, row by row, in one pass (``[rows, d]``)."""
    lib = _lib_or_raise()
    _check((h, delta, weight, out))
    rows, d = h.shape
    if out.shape != h.shape or delta.shape != h.shape or weight.shape != (d,):
        raise InvalidRequestError(
            f"add_rms_norm: h{tuple(h.shape)} delta{tuple(delta.shape)} out{tuple(out.shape)}"
        )
    code = lib.pagedkv_add_rms_norm_f32(h.data_ptr(), delta.data_ptr(), d, weight.data_ptr(),
                                        out.data_ptr(), rows, d, eps, _vector_width)  # fmt: skip
    if code:
        raise InvalidRequestError(f"add_rms_norm: width {d} is below {_vector_width}")


def rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    q_out: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> None:
    """RoPE on the q and k heads of ``qkv`` (``[rows, heads + 2 * kv_heads, head_dim]``, the
    fused projection), q into ``q_out`` (``[rows, heads, head_dim]``), k and v into one
    layer's pools (``[kv_heads, blocks, block_size, head_dim]``) at ``slots`` (``[rows]``
    int64). ``cos``/``sin``: ``[rows, head_dim]``. ``qk_norm`` = (q weight, k weight, eps):
    the per-head RMSNorm before RoPE (Qwen3). Changes nothing when a slot is out of range."""
    lib = _lib_or_raise()
    _check((qkv, cos, sin, q_out, k_pool, v_pool))
    rows, nh, hd = q_out.shape
    nkv = k_pool.shape[0]
    num_slots = k_pool.shape[1] * k_pool.shape[2]
    if (
        qkv.shape != (rows, nh + 2 * nkv, hd)
        or cos.shape != (rows, hd)
        or sin.shape != (rows, hd)
        or slots.shape != (rows,)
        or slots.dtype is not torch.int64
        or not slots.is_contiguous()
        or v_pool.shape != k_pool.shape
        or k_pool.shape[3] != hd
    ):
        raise InvalidRequestError(
            f"rope_write: qkv{tuple(qkv.shape)} q_out{tuple(q_out.shape)} pool"
            f"{tuple(k_pool.shape)} cos{tuple(cos.shape)} slots{tuple(slots.shape)}"
        )
    qn = kn = None
    eps = 0.0
    if qk_norm is not None:
        _check(qk_norm[:2])
        qn, kn, eps = qk_norm[0].data_ptr(), qk_norm[1].data_ptr(), qk_norm[2]
    code = lib.pagedkv_rope_write_f32(
        qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), q_out.data_ptr(),
        k_pool.data_ptr(), v_pool.data_ptr(), rows, nh, nkv, hd, num_slots, qn, kn, eps,
        _vector_width,
    )  # fmt: skip
    if code:
        raise InvalidRequestError(
            f"rope_write: a slot is outside [0, {num_slots}) or head_dim {hd} is unsupported"
        )


QKNorm = tuple[torch.Tensor, torch.Tensor]  # per-head q and k RMSNorm weights (Qwen3)


class ModelLayerOps:
    """A model's norm weights for the native layer ops, checked once at load (contiguous
    float32, ``[hidden]`` and ``[head_dim]``); ``step`` allocates and checks one step's
    buffers. Raises InvalidRequestError when the kernels are unavailable or a weight does not
    fit (the model then keeps the torch ops)."""

    def __init__(
        self,
        input_norms: Sequence[torch.Tensor],
        post_norms: Sequence[torch.Tensor],
        final_norm: torch.Tensor,
        qk_norms: Sequence[QKNorm] | None,
        eps: float,
        head_dim: int,
    ) -> None:
        self.lib = _lib_or_raise()
        hidden = final_norm.shape[0]
        _check((*input_norms, *post_norms, final_norm))
        if qk_norms is not None:
            _check(tuple(t for pair in qk_norms for t in pair))
        if (
            not supports(hidden, head_dim)
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

    def step(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        cache: PagedKVCache,
        num_heads: int,
        intermediate_size: int,
    ) -> StepBuffers:
        return StepBuffers(self, h, cos, sin, slots, cache, num_heads, intermediate_size)


class StepBuffers:
    """One step's buffers for the native layer ops, allocated and checked once so that each
    per-layer call is one ctypes call. ``h`` (``[tokens, hidden]``) is the residual stream,
    updated in place; ``x`` holds each norm's output; ``qkv``, ``q``, ``att``, ``o``,
    ``gate_up``, ``act`` and ``down`` are the projections' and attention's outputs.
    Invariant: every buffer is contiguous float32 on the CPU with the shapes of this step;
    a projection output that is not the step's own buffer (a quantized layer's) is checked
    on each call."""

    def __init__(
        self,
        ops: ModelLayerOps,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        cache: PagedKVCache,
        num_heads: int,
        intermediate_size: int,
    ) -> None:
        n, hd, hidden = h.shape[0], ops.head_dim, ops.hidden
        nkv = cache.spec.num_kv_heads
        _check((h, cos, sin, cache.k[0], cache.v[0]))
        if (
            h.shape != (n, hidden)
            or cos.shape != (n, hd)
            or sin.shape != (n, hd)
            or slots.shape != (n,)
            or slots.dtype is not torch.int64
            or not slots.is_contiguous()
            or cache.k[0].shape[3] != hd
            or cache.spec.dtype is not torch.float32
        ):
            raise InvalidRequestError(
                f"native layer ops: h{tuple(h.shape)} cos{tuple(cos.shape)} slots"
                f"{tuple(slots.shape)} pool{tuple(cache.k[0].shape)} do not fit"
            )
        self.ops, self.cache, self.h = ops, cache, h
        self.x, self.o, self.down = torch.empty_like(h), torch.empty_like(h), torch.empty_like(h)
        self.qkv = torch.empty(n, (num_heads + 2 * nkv) * hd)
        self.q, self.att = torch.empty(n, num_heads, hd), torch.empty(n, num_heads, hd)
        self.att_rows = self.att.view(n, num_heads * hd)
        self.gate_up = torch.empty(n, 2 * intermediate_size)
        self.gate = self.gate_up[:, :intermediate_size]
        self.up = self.gate_up[:, intermediate_size:]
        self.act = torch.empty(n, intermediate_size)
        self._keep = (cos, sin, slots)  # the kernels read their memory
        self._rope_args = (cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), self.q.data_ptr())
        self._dims = (n, num_heads, nkv, hd, cache.num_slots)
        self._qkv_shape = (n, (num_heads + 2 * nkv) * hd)
        self._h, self._x = h.data_ptr(), self.x.data_ptr()
        self._vw = _vector_width

    def input_norm(self) -> None:
        """``x = norm(h)`` with layer 0's input norm."""
        ops = self.ops
        n, hidden = self.h.shape
        ops.lib.pagedkv_rms_norm_f32(self._h, hidden, ops.input_ptrs[0], self._x, n, hidden,
                                     ops.eps, self._vw)  # fmt: skip

    def _delta_ptr(self, delta: torch.Tensor) -> int:
        if delta is not self.o and delta is not self.down:
            _check((delta,))
            if delta.shape != self.h.shape:
                raise InvalidRequestError(f"a residual of shape {tuple(delta.shape)}")
        return delta.data_ptr()

    def add_post_norm(self, layer: int, delta: torch.Tensor) -> None:
        """``h += delta`` (the attention output) and ``x = post_attention_norm(h)``."""
        self._add_norm(self._delta_ptr(delta), self.ops.post_ptrs[layer])

    def add_next_norm(self, layer: int, delta: torch.Tensor) -> None:
        """``h += delta`` (the MLP output) and ``x`` = the next layer's input norm of ``h``
        (the final norm after the last layer)."""
        self._add_norm(self._delta_ptr(delta), self.ops.next_ptrs[layer])

    def _add_norm(self, delta: int, weight: int) -> None:
        ops = self.ops
        n, hidden = self.h.shape
        ops.lib.pagedkv_add_rms_norm_f32(self._h, delta, hidden, weight, self._x, n, hidden,
                                         ops.eps, self._vw)  # fmt: skip

    def rope_write(self, layer: int, qkv: torch.Tensor) -> None:
        """RoPE (after the per-head norms when the model has them) on ``qkv``'s q and k,
        q into ``self.q``, k and v into layer ``layer``'s pools at the step's slots."""
        if qkv is not self.qkv:
            _check((qkv,))
            if qkv.shape != self._qkv_shape:
                raise InvalidRequestError(f"a qkv projection of shape {tuple(qkv.shape)}")
        ops, cache = self.ops, self.cache
        qn, kn = ops.qk_ptrs[layer] if ops.qk_ptrs else (None, None)
        code = ops.lib.pagedkv_rope_write_f32(
            qkv.data_ptr(), *self._rope_args, cache.k[layer].data_ptr(),
            cache.v[layer].data_ptr(), *self._dims, qn, kn, ops.eps, self._vw,
        )  # fmt: skip
        if code:
            raise InvalidRequestError(
                f"rope_write: a slot is outside [0, {self._dims[-1]}) (the cache's slots)"
            )
