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
import weakref
from collections.abc import Callable, Sequence
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
    lib.pagedkv_argmax_f32.argtypes = [ptr, i64, i64, i64, ptr]
    for fn in (
        lib.pagedkv_rms_norm_f32,
        lib.pagedkv_add_rms_norm_f32,
        lib.pagedkv_rope_write_f32,
        lib.pagedkv_argmax_f32,
    ):
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


def argmax_rows(x: torch.Tensor) -> list[int] | None:
    """``x.argmax(dim=-1).tolist()`` of a 2-D float32 CPU tensor with contiguous rows, the
    same indices (the first maximum; the first NaN where a row holds one), in one pass that
    vectorises (torch's CPU argmax does not: ~60-90 us for a 49,152-token row here). None
    when the kernels are unavailable or ``x`` is not such a tensor (use torch's then)."""
    if (
        _lib is None
        or x.dim() != 2
        or x.dtype is not torch.float32
        or x.device.type != "cpu"
        or x.stride(1) != 1
        or x.shape[1] == 0
        or x.stride(0) < x.shape[1]
    ):
        return None
    rows = x.shape[0]
    out = (ctypes.c_int64 * rows)()
    if _lib.pagedkv_argmax_f32(x.data_ptr(), rows, x.shape[1], x.stride(0), out):
        return None
    return list(out)


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
_MAX_KEPT_ROWS = 64  # ModelLayerOps keeps the buffers of steps up to this many tokens ...
_MAX_KEPT = 8  # ... for this many row counts (the oldest is dropped first)
_V, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


def _raw(lib: ctypes.CDLL, name: str) -> Callable[..., int]:
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
        self.raw_norm = _raw(self.lib, "pagedkv_rms_norm_f32")
        self.raw_add_norm = _raw(self.lib, "pagedkv_add_rms_norm_f32")
        self.raw_rope = _raw(self.lib, "pagedkv_rope_write_f32")
        self._kept: dict[int, StepBuffers] = {}  # rows -> the last step's buffers

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
    step's shapes; the prebuilt arguments point at these buffers, the norm weights and the
    pools of ``cache`` as they were when built (``fits`` says whether they still are); a
    projection output that is not the step's own buffer (a quantized layer's) is checked
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
        _check((cache.k[0], cache.v[0]))
        if cache.k[0].shape[3] != hd or cache.spec.dtype is not torch.float32:
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
        self._vw = _vector_width
        rows, width, eps, vw = _I(n), _I(hidden), _F(ops.eps), _I(_vector_width)
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
        """The step's inputs: ``h`` = the embedding rows of ``input_ids``, ``cos``/``sin``
        = the tables' rows at ``positions``, ``slots`` = the K/V slots (``[tokens]``
        int64 each); and a new ``out`` for the final norm."""
        n = self.h.shape[0]
        if input_ids.shape != (n,) or positions.shape != (n,) or slots.shape != (n,):
            raise InvalidRequestError(
                f"native layer ops: ids{tuple(input_ids.shape)} positions"
                f"{tuple(positions.shape)} slots{tuple(slots.shape)} for a {n}-token step"
            )
        torch.index_select(embed, 0, input_ids, out=self.h)
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
        _check((delta,))
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
        q into ``self.q``, k and v into layer ``layer``'s pools at the step's slots."""
        if qkv is self.qkv:
            code = self.ops.raw_rope(*self._rope[layer])
        else:
            _check((qkv,))
            if qkv.shape != self._qkv_shape:
                raise InvalidRequestError(f"a qkv projection of shape {tuple(qkv.shape)}")
            code = self.ops.raw_rope(_V(qkv.data_ptr()), *self._rope[layer][1:])
        if code:
            raise InvalidRequestError(
                f"rope_write: a slot is outside [0, {self._dims[-1]}) (the cache's slots)"
            )
