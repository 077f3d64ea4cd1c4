"""A Llama layer's linear projection: the float layer (:class:`Projection`, its weight kept
transposed, ``[in, out]``), the bfloat16 layer of a CPU model computing in float32
(:class:`Bf16Projection`, its weight in the bf16 kernel's column tiles), the same layer in bf16
arithmetic on AMX (:class:`Bf16DotProjection`, ``matmul_precision="medium"``), and the helpers
the model's forwards call on any ``Linear`` (any of these, or a quantized layer with the same
call signature)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedkv.engine import bf16_dot, bf16_linear, fewrow
from pagedkv.engine.bf16_dot import PairedWeight
from pagedkv.engine.bf16_linear import TiledWeight
from pagedkv.engine.qlinear import QuantizedProjection
from pagedkv.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class Projection:
    """A linear layer with its weight stored transposed (``[in, out]``) and an optional bias.
    ``few_rows``: calls of 2..32 rows take :mod:`pagedkv.engine.fewrow`'s kernel
    (``EngineConfig.linear_kernel="native"``), the others ``torch.mm`` (in the weight's
    dtype: a bf16 CPU model computing in float32 holds :class:`Bf16Projection` instead)."""

    weight_t: torch.Tensor
    bias: torch.Tensor | None
    few_rows: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.few_rows and fewrow.accepts(x):
            return fewrow.linear(x, self.weight_t, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight_t)
        return torch.addmm(self.bias, x, self.weight_t)

    def into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``self(x)`` written into ``out`` (the same kernel, so the same bits)."""
        if self.few_rows and fewrow.accepts(x):
            return fewrow.linear(x, self.weight_t, self.bias, out)
        if self.bias is None:
            return torch.mm(x, self.weight_t, out=out)
        return torch.addmm(self.bias, x, self.weight_t, out=out)


@dataclass(frozen=True, slots=True)
class Bf16Projection:
    """A linear layer with a bfloat16 weight in column tiles and an optional float32 bias,
    called with float32 inputs: :mod:`pagedkv.engine.bf16_linear`'s kernel (bf16 storage,
    float32 compute; more than ``MAX_ROWS`` rows: ``bf16_linear.kernel_prefill`` says how)."""

    weight: TiledWeight
    bias: torch.Tensor | None

    @classmethod
    def from_weight_t(cls, weight_t: torch.Tensor, bias: torch.Tensor | None) -> Bf16Projection:
        return cls(TiledWeight.from_weight_t(weight_t), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return bf16_linear.linear(x, self.weight, self.bias)

    def into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``self(x)`` written into ``out`` (the same kernel, so the same bits)."""
        return bf16_linear.linear(x, self.weight, self.bias, out)


@dataclass(frozen=True, slots=True)
class Bf16DotProjection:
    """A bfloat16 linear layer computing in bf16 arithmetic (inputs rounded to bf16, float32
    sums) on AMX: :mod:`pagedkv.engine.bf16_dot`, ``matmul_precision="medium"``. Converts
    to and from :class:`Bf16Projection` exactly (the weight is repacked, not rounded)."""

    weight: PairedWeight
    bias: torch.Tensor | None

    @classmethod
    def from_bf16(cls, p: Bf16Projection) -> Bf16DotProjection:
        return cls(PairedWeight.from_tiled(p.weight), p.bias)

    def to_bf16(self) -> Bf16Projection:
        return Bf16Projection(self.weight.tiled(), self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return bf16_dot.linear(x, self.weight, self.bias)

    def into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``self(x)`` written into ``out`` (the same kernel, so the same bits)."""
        return bf16_dot.linear(x, self.weight, self.bias, out)


Linear = Callable[[torch.Tensor], torch.Tensor]  # a Projection, a bf16 one, or quantized


def linear_into(p: Linear, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``p(x)``, into ``out`` when ``p`` is a float projection; contiguous either way."""
    if isinstance(p, Projection | Bf16Projection | Bf16DotProjection):
        return p.into(x, out)
    return p(x).contiguous()


def unit_stride(w: torch.Tensor) -> bool:
    """A float32 CPU matrix with unit column stride (what ``fewrow.linear_nt`` reads)."""
    return w.dtype is torch.float32 and w.dim() == 2 and w.stride(1) == 1


def to_quantized(p: Linear) -> QuantizedProjection:
    """``p`` as an int8 weight-only layer (:mod:`pagedkv.engine.qlinear`); only a float
    :class:`Projection` can be quantized (a bfloat16 model's quantization is refused before
    this, ``check_quantization``)."""
    if not isinstance(p, Projection):
        raise InvalidRequestError(f"cannot quantize a {type(p).__name__}")
    return QuantizedProjection.from_float(p.weight_t, p.bias)
