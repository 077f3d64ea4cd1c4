"""A model's linear layers bound to one step's buffers (:class:`BoundLinears`): for each layer,
the q/k/v, o, gate/up and down projections as zero-argument calls that write into the
``StepBuffers`` of the native layer ops and return the output.

At batch 1 a decode step makes ~120 linear calls. Through ``linear_into`` each one pays the
Python dispatch of its layer type, the kernel wrapper's checks, an output allocation (the
int8 layers) and the argument conversion of a ctypes call, and a layer output that is not the
step's own buffer then costs the layer ops a check and a conversion too. Bound once per step
size and thread count (the buffers are kept across steps, so in practice once), a call is:

- a float32 ``Projection``: ``torch.mm(x, W, out=out)`` (``addmm`` with a bias) through
  ``functools.partial``, the call ``Projection.into`` makes, so the same bits;
- a ``Bf16Projection``: :func:`bf16_linear.bind_into`'s prebuilt kernel call;
- a ``Bf16DotProjection`` (bf16 arithmetic on AMX): :func:`bf16_dot.bind_into`'s; the down
  projection reads the gate and up halves and multiplies them while it packs its input
  (``gated``), so the step skips SiLU's separate multiply and its buffer;
- an int8 ``QuantizedProjection``: :meth:`QuantizedProjection.bind_into`'s;
- a ``GGUFProjection`` (the file's blocks, float32 or 8-bit activations):
  :meth:`GGUFProjection.bind_into`'s;
- anything else (the few-row kernel's rows, a benchmark's stub, a subclass):
  ``linear_into`` as before.

Every bound call runs the kernel and thread split its layer would run now, so a step's bits
do not change.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Sequence
from functools import partial

import torch

from pagedkv.engine import bf16_dot, bf16_linear, fewrow
from pagedkv.engine.bound_call import BoundKernel
from pagedkv.engine.gguf_qlinear import GGUFProjection
from pagedkv.engine.layer_op_buffers import StepBuffers
from pagedkv.engine.models.projection import (
    Bf16DotProjection,
    Bf16Projection,
    Linear,
    Projection,
    linear_into,
)
from pagedkv.engine.models.tiled_layers import TiledLayers
from pagedkv.engine.qlinear import QuantizedProjection

Call = Callable[[], torch.Tensor]
LayerCalls = tuple[Call, Call, Call, Call]  # q/k/v, o, gate/up, down


def bind_into(p: Linear, x: torch.Tensor, out: torch.Tensor) -> Call:
    """``linear_into(p, x, out)`` as a zero-argument call (module docstring)."""
    if type(p) is Bf16Projection:
        bound = bf16_linear.bind_into(x, p.weight, p.bias, out)
        if bound is not None:
            return bound
    elif type(p) is Bf16DotProjection:
        dot = bf16_dot.bind_into(x, p.weight, p.bias, out)
        if dot is not None:
            return dot
    elif type(p) is Projection:
        w, bias = p.weight_t, p.bias
        if not (p.few_rows and fewrow.accepts(x)) and w.dtype is x.dtype is out.dtype:
            if bias is None:
                return partial(torch.mm, x, w, out=out)
            return partial(torch.addmm, bias, x, w, out=out)
    elif type(p) is QuantizedProjection or type(p) is GGUFProjection:
        bound = p.bind_into(x, out)
        if bound is not None:
            return bound
    return partial(linear_into, p, x, out)


def _bind_mlp(gate_up: Linear, down: Linear, x: torch.Tensor, out: torch.Tensor) -> Call | None:
    """Layer ``gate_up``/``down``'s SwiGLU in one call (:func:`bf16_dot.mlp`: the same bits
    as gate/up, SiLU and the gated down, without the gate/up output), or None where it
    cannot run (other layer types, a bias, AMX or torch's exp unavailable)."""
    if not (
        type(gate_up) is Bf16DotProjection and type(down) is Bf16DotProjection
        and gate_up.bias is None and down.bias is None
    ):  # fmt: skip
        return None
    return bf16_dot.bind_mlp(x, gate_up.weight, down.weight, out)


def _bind_gated(p: Linear, buf: StepBuffers) -> Call | None:
    """The down projection ``p`` reading ``buf.gate * buf.up`` itself (the AMX kernel's
    gated packing: torch.mul's float32 products, rounded to bf16 as its input would be, so
    the same bits), or None where it cannot (another layer type, or AMX not running)."""
    if type(p) is not Bf16DotProjection:
        return None
    return bf16_dot.bind_into(buf.gate, p.weight, p.bias, buf.down, up=buf.up)


class BoundLinears:
    """Every layer's linear calls over one step's buffers (``calls[i]``, :data:`LayerCalls`),
    and what they were bound for. ``gated[i]``: layer ``i``'s down call multiplies
    ``buf.gate`` by ``buf.up`` itself (the caller applies SiLU to ``buf.gate`` in place and
    skips ``buf.act``). ``mlp[i]``, where not None, computes layer ``i``'s gate/up, SiLU and
    down into ``buf.down`` in one call, with the bits of those three (the Python layer loop
    takes it; the decode programs keep the three calls). ``tiled``, where not None, is the
    same loop with the norms writing bf16 A tiles (:class:`TiledLayers`: the same bits).

    Invariants: ``calls[i]`` computes layer ``i``'s projections of ``buf``'s inputs into
    ``buf``'s outputs with the layer objects in ``linears`` (held, so their weights outlive
    the calls) at ``threads`` intra-op threads; ``fits`` is True only while the model's layers
    are those same objects (by identity) and the thread count is the same.
    Complexity: binding O(layers); ``fits`` O(layers), in C (``map``)."""

    def __init__(self, groups: Sequence[Sequence[Linear]], buf: StepBuffers) -> None:
        self.threads = torch.get_num_threads()
        self.linears = [list(g) for g in groups]
        qkv, o, gate_up, down = self.linears
        downs = [_bind_gated(p, buf) for p in down]
        self.gated = [d is not None for d in downs]
        down_calls = [
            bind_into(p, buf.act, buf.down) if d is None else d
            for p, d in zip(down, downs, strict=True)
        ]
        self._mlp_io = (buf.x, buf.down)  # the tensors, not buf: a weak dict is keyed by it
        self.calls: list[LayerCalls] = [
            (
                bind_into(qkv[i], buf.x, buf.qkv),
                bind_into(o[i], buf.att_rows, buf.o),
                bind_into(gate_up[i], buf.x, buf.gate_up),
                down_calls[i],
            )
            for i in range(len(qkv))
        ]
        o_into_buf = all(type(c[1]) is BoundKernel and c[1].out is buf.o for c in self.calls)
        self.tiled = TiledLayers.build(buf, self.linears) if o_into_buf else None

    @functools.cached_property
    def mlp(self) -> list[Call | None]:
        """Each layer's one-call MLP (or None), bound on first use: a prefill step whose
        loop takes ``tiled`` never needs them, and its buffers are not kept."""
        _, _, gate_up, down = self.linears
        return [_bind_mlp(g, d, *self._mlp_io) for g, d in zip(gate_up, down, strict=True)]

    def fits(self, groups: Sequence[Sequence[Linear]]) -> bool:
        """Whether these calls still compute the model's layers ``groups``."""
        return self.threads == torch.get_num_threads() and all(
            len(g) == len(mine) and not any(map(operator.is_not, g, mine))
            for g, mine in zip(groups, self.linears, strict=True)
        )
