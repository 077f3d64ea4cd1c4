"""A medium model's layer loop with the norms writing bf16 A tiles (:class:`TiledLayers`).

Under ``matmul_precision="medium"`` every linear layer rounds its float32 input to bf16 and
packs it into AMX A tiles (``csrc/bf16_tiles.h``) before multiplying. The two norms of a layer
feed the q/k/v projection and the MLP, and write their float32 rows only for that packing: at
a 1,024-token prefill of SmolLM2 that is 2.4 MB written, read back and written again as 1.2 MB
of tiles, twice per layer. Here the norm (``layer_ops``' ``pagedkv_add_rms_norm_tiles``) writes
the tiles itself and the q/k/v and MLP calls read them (``bf16_dot.bind_linear_tiles``,
``bind_mlp_tiles``). Each tile value is the float32 norm's value rounded as the packing rounds
it, so every output has the bits of the float32 path. Layer 0's q/k/v (after the step's input
norm) and the final norm keep their float32 rows. Where the AMX prompt kernel serves every
row of a step, the attention writes the o projection's input as tiles too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.engine import bf16_dot, layer_ops
from pagedkv.engine.bound_call import BoundKernel
from pagedkv.engine.layer_op_buffers import StepBuffers
from pagedkv.engine.models.projection import Bf16DotProjection, Linear

Call = BoundKernel


class TiledLayers:
    """Per layer: ``qkv[i]`` (None for layer 0) and ``mlp[i]`` read ``tiles``;
    ``post_norm[i]`` does ``h += buf.o`` and writes layer ``i``'s post-attention norm as tiles;
    ``next_norm[i]`` (``i`` < the last layer) ``h += buf.down`` and layer ``i + 1``'s input
    norm as tiles. ``qkv[i]`` writes ``buf.qkv``, ``mlp[i]`` ``buf.down``. ``o``, where not
    None, is each layer's o projection into ``buf.o`` from the attention's outputs written as
    tiles (``attention.attend_tiles``, for steps of prompt chunks), and those tiles.

    Invariants: built only when every layer's q/k/v, gate/up and down are bf16 AMX layers
    (``Bf16DotProjection``; gate/up and down without a bias) and the kernels run here; the
    calls' buffers are ``buf``'s and ``tiles`` (held), the weights those of ``linears``.
    Nothing here holds ``buf`` itself (only its tensors): the model keeps these calls in a
    dictionary keyed weakly by ``buf``, which a reference to it would never let go."""

    def __init__(
        self,
        qkv: list[Call | None],
        mlp: list[Call],
        norms: tuple[list[Call], list[Call]],
        tiles: torch.Tensor,
        o: tuple[list[Call], torch.Tensor] | None,
    ) -> None:
        self.qkv, self.mlp, self.tiles, self.o = qkv, mlp, tiles, o
        self.post_norm, self.next_norm = norms

    @classmethod
    def build(cls, buf: StepBuffers, linears: Sequence[Sequence[Linear]]) -> TiledLayers | None:
        """The tiled calls over ``buf`` for ``linears`` (q/k/v, o, gate/up, down per layer),
        or None where any layer or kernel does not take them (module docstring)."""
        qkv_layers = [p for p in linears[0] if type(p) is Bf16DotProjection]
        gate_up = [p for p in linears[2] if type(p) is Bf16DotProjection and p.bias is None]
        down = [p for p in linears[3] if type(p) is Bf16DotProjection and p.bias is None]
        counts = {len(linears[0]), len(qkv_layers), len(gate_up), len(down), len(linears[3])}
        if len(counts) != 1 or not bf16_dot.mlp_ready():
            return None
        rows, hidden = buf.h.shape
        tiles = bf16_dot.tiles_for(rows, hidden)
        qkv = [bf16_dot.bind_linear_tiles(tiles, rows, p.weight, p.bias, buf.qkv)
               for p in qkv_layers[1:]]  # fmt: skip
        mlp = [
            bf16_dot.bind_mlp_tiles(tiles, rows, g.weight, d.weight, buf.down)
            for g, d in zip(gate_up, down, strict=True)
        ]
        bound_qkv = [c for c in qkv if c is not None]
        bound_mlp = [c for c in mlp if c is not None]
        if len(bound_qkv) != len(qkv) or len(bound_mlp) != len(mlp):
            return None
        o = cls._o_calls(buf, linears[1])
        post = [_norm(buf, buf.o, w, tiles) for w in buf.ops.post_ptrs]
        nxt = [_norm(buf, buf.down, w, tiles) for w in buf.ops.next_ptrs[:-1]]
        return cls([None, *bound_qkv], bound_mlp, (post, nxt), tiles, o)

    @staticmethod
    def _o_calls(
        buf: StepBuffers, layers: Sequence[Linear]
    ) -> tuple[list[Call], torch.Tensor] | None:
        """Each layer's o projection over attention outputs written as tiles (``o``), and
        those tiles; None where a layer is not a bf16 AMX layer."""
        rows, width = buf.att_rows.shape
        att = bf16_dot.tiles_for(rows, width)
        calls = [
            bf16_dot.bind_linear_tiles(att, rows, p.weight, p.bias, buf.o)
            if type(p) is Bf16DotProjection
            else None
            for p in layers
        ]
        bound = [c for c in calls if c is not None]
        return (bound, att) if len(bound) == len(calls) else None


def _norm(buf: StepBuffers, delta: torch.Tensor, weight: int, tiles: torch.Tensor) -> Call:
    """``h += delta``, then the norm with ``weight`` (an address) written as tiles."""
    rows, hidden = buf.h.shape
    kp, eps, vw = bf16_dot.tiles_k(hidden), buf.ops.eps, layer_ops.vector_width()
    args = (buf.h.data_ptr(), delta.data_ptr(), hidden, weight, tiles.data_ptr(), kp, rows,
            hidden, eps, vw)  # fmt: skip
    return BoundKernel(layer_ops.library(), "pagedkv_add_rms_norm_tiles", [args], tiles,
                       (buf.h, delta, tiles), "native layer ops")  # fmt: skip
