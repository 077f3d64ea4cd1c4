"""A decode step's layer loop as native segments (:class:`LayerProgram`), for ``LlamaModel``.

``LlamaModel._forward_fused`` calls per layer: q/k/v, RoPE + K/V write, attention, o, the
residual add + post-attention norm, gate/up, SiLU (and its multiply), down, the residual add +
next norm: ~10 calls from Python, ~300 a step. Where every call but SiLU's is a native kernel
with one part (:meth:`BoundKernel.recorded`) and attention is the one-call decode kernel, the
calls between two SiLUs run as one :class:`step_program.StepProgram` segment:

    segment 0       input norm, layer 0's q/k/v .. gate/up
    segment i       layer i-1's down + next norm, layer i's q/k/v .. gate/up   (0 < i < L)
    segment L       layer L-1's down + the final norm (into the step's ``out``)

and SiLU (torch's op, so its bits) runs between segments, as before. Where ``layer_ops``'
SiLU gives torch's bits for the step's shape and thread count (checked once per shape), it
runs inside instead, and the whole loop is one segment. Where every layer has the one-call
MLP of the AMX path (``BoundLinears.mlp``: gate/up, SiLU and down, the bits of the three), it
replaces those calls and the loop is one segment too. The same kernels run in the same order
on the same buffers, so the step's bits do not change. Per step only the
attention's tables/lengths/starts/sequence count and the final norm's output pointer change;
``set_step`` patches them.
"""

from __future__ import annotations

import ctypes
import logging
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch

from pagedkv.engine import layer_ops, native, step_program
from pagedkv.engine.bound_call import BoundKernel
from pagedkv.engine.kv_cache import PagedKVCache
from pagedkv.engine.layer_op_buffers import ModelLayerOps, StepBuffers
from pagedkv.engine.models.bound_linears import BoundLinears
from pagedkv.engine.step_program import Recorded, StepProgram, record
from pagedkv.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_STEP_WORDS = slice(4, 9)  # a decode call's tables, lens, starts, seqs, table stride
_OUT_WORD = 4  # add_rms_norm's output pointer


def _native(rec: Recorded | None) -> Recorded:
    if rec is None:
        raise InvalidRequestError("a call of the step has no native form")
    return rec


def _linear(call: object, out: torch.Tensor) -> tuple[Recorded, str]:
    """A bound linear call writing ``out`` as recorded, with its failure message; raises
    InvalidRequestError when it has no native form."""
    if type(call) is not BoundKernel or call.out is not out:
        raise InvalidRequestError("a linear call of the step has no native form")
    return _native(call.recorded()), call.failure()


class LayerProgram:
    """A step's layer loop as segments (module docstring), built for one ``StepBuffers``,
    its ``BoundLinears`` and one decode-call shape; ``fits`` says whether a step's decode
    calls have that shape. Raises InvalidRequestError when a call has no native form.

    Invariants: ``program``'s call ``i`` is the call the Python loop would make i-th, with its
    arguments (the per-step words as the last ``set_step`` left them), and ``messages[i]``
    what that call raises when it fails; the linears' kernels and weights are held (``buf``
    is not: a program is kept in a dict keyed weakly by ``buf`` and runs only with it)."""

    def __init__(
        self,
        buf: StepBuffers,
        linears: BoundLinears,
        decodes: Sequence[native._BoundDecode],
        pools: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]],
    ) -> None:
        rope_fail = f"rope_write: a slot is outside [0, {buf.num_slots}) (the cache's slots)"
        norm_fail = "add_rms_norm rejected its inputs"
        mlps = [m if isinstance(m, BoundKernel) and m.out is buf.down else None
                for m in linears.mlp]  # fmt: skip
        self.fused_mlp = all(m is not None for m in mlps)  # gate/up, SiLU, down in one call
        # either way one segment: the whole loop
        self.native_silu = self.fused_mlp or _silu_matches(buf, linears)
        segments: list[list[tuple[Recorded, str]]] = []
        segment = [
            (_native(record(buf.ops.raw_norm, buf.norm0_args)), "rms_norm rejected its inputs")
        ]
        self._decode_rows: list[int] = []  # each layer's attention call, in program order
        for i, (qkv, o, gate_up, down) in enumerate(linears.calls):
            words, scale = decodes[i].words(pools[0][i], pools[1][i])
            decode = Recorded(decodes[i].symbol, decodes[i].address, words, (scale,))
            done = sum(map(len, segments))
            self._decode_rows.append(done + len(segment) + 2)  # after q/k/v and RoPE
            segment += [
                _linear(qkv, buf.qkv),
                (_native(record(buf.rope_fn, buf.rope_args[i])), rope_fail),
                (decode, native.DECODE_FAILURE),
                _linear(o, buf.o),
                (_native(record(buf.ops.raw_add_norm, buf.post_args[i])), norm_fail),
            ]
            mlp = mlps[i]
            if mlp is not None:
                segment.append(_linear(mlp, buf.down))
            else:
                segment.append(_linear(gate_up, buf.gate_up))
                if self.native_silu:
                    segment.append((_silu(buf, linears.gated[i]), "SiLU rejected its inputs"))
                else:
                    segments.append(segment)  # then torch's SiLU, from Python
                    segment = []
                segment.append(_linear(down, buf.down))
            segment.append((_native(record(buf.ops.raw_add_norm, buf.next_args(i))), norm_fail))
        segments.append(segment)
        self.messages = [message for seg in segments for _, message in seg]
        self._final_row = len(self.messages) - 1  # the last norm, into the step's ``out``
        self.program = StepProgram([[rec for rec, _ in seg] for seg in segments])
        self.shape = _shape(decodes[0])
        self._keep = linears  # its kernels and weights; and which down calls multiply
        self._step: Sequence[native._BoundDecode] = ()

    def fits(self, decodes: Sequence[native._BoundDecode]) -> bool:
        """Whether this step's decode calls have the shape the program was built for."""
        return all(_shape(d) == self.shape for d in {id(d): d for d in decodes}.values())

    def set_step(
        self, decodes: Sequence[native._BoundDecode], k: torch.Tensor, v: torch.Tensor,
        out: torch.Tensor,
    ) -> None:  # fmt: skip
        """Patch in this step's attention words (``decodes[i]`` layer ``i``'s call; ``k``/
        ``v`` any layer's pools, for the check) and the final norm's output ``out``."""
        words = self.program.words
        first: dict[int, np.ndarray] = {}
        for row, d in zip(self._decode_rows, decodes, strict=True):
            step = first.get(id(d))
            if step is None:
                step = first[id(d)] = np.asarray(d.words(k, v)[0][_STEP_WORDS], dtype=np.int64)
            words[row, _STEP_WORDS] = step
        words[self._final_row, _OUT_WORD] = out.data_ptr()
        self._step = decodes  # their tables and lengths, which the words point into

    def run_step(self, buf: StepBuffers) -> None:
        """The layer loop of ``LlamaModel._forward_fused`` for the step ``set_step`` patched
        in: one segment (SiLU inside), or segments with torch's SiLU (and its multiply,
        unless the down projection multiplies) between them."""
        if self.native_silu:
            self.run(0)
            return
        silu_ = torch._C._nn.silu_
        for i, down_multiplies in enumerate(self._keep.gated):
            self.run(i)
            silu_(buf.gate)
            if not down_multiplies:
                torch.mul(buf.gate, buf.up, out=buf.act)
        self.run(len(self._keep.gated))

    def run(self, segment: int) -> None:
        failed = self.program.run(segment)
        if failed >= 0:
            raise InvalidRequestError(self.messages[failed])


def _silu_matches(buf: StepBuffers, linears: BoundLinears) -> bool:
    rows, width = buf.gate.shape
    return layer_ops.silu_matches_torch(rows, width, linears.threads)


def _silu(buf: StepBuffers, gated: bool) -> Recorded:
    """SiLU of ``buf.gate`` in place, then (unless the down projection multiplies by the up
    half itself) ``buf.act = buf.gate * buf.up``: what ``_forward_fused`` does with torch."""
    rows, width = buf.gate.shape
    fn = layer_ops.library()["pagedkv_silu_f32"]
    up, act = (0, 0) if gated else (buf.up.data_ptr(), buf.act.data_ptr())
    words = (buf.gate.data_ptr(), buf.gate.stride(0), up, buf.up.stride(0), act, width, rows, width)
    address = ctypes.cast(fn, ctypes.c_void_p).value
    return Recorded("pagedkv_silu_f32", int(address or 0), words, ())


def _shape(d: native._BoundDecode) -> tuple[object, ...]:
    """What a program fixes of a decode call: its kernel and every argument but the step's."""
    return (d.symbol, d._io, *d._rest[5:])


Kept = tuple[BoundLinears, LayerProgram | None]


class LayerPrograms:
    """A model's layer programs, one per kept ``StepBuffers`` (held weakly: dropped with the
    buffers), each for the ``BoundLinears`` it was built with; None where those calls have no
    native form, so a step does not try to build it again."""

    def __init__(self) -> None:
        self._kept: weakref.WeakKeyDictionary[StepBuffers, Kept] = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        return len(self._kept)

    def items(self) -> list[tuple[StepBuffers, Kept]]:
        return list(self._kept.items())

    def values(self) -> list[Kept]:
        return list(self._kept.values())

    def for_step(
        self,
        buf: StepBuffers,
        linears: BoundLinears,
        decodes: Sequence[Callable[[torch.Tensor, torch.Tensor], None] | None],
        cache: PagedKVCache,
    ) -> LayerProgram | None:
        """The step's program, given this step's attention calls and output; None where a
        call has no native form (then the Python loop runs: a prefill chunk, float32's
        torch.mm, a Python thread split), the buffers are not kept, or the library is
        unavailable."""
        native_decodes = [d for d in decodes if isinstance(d, native._BoundDecode)]
        if (
            len(native_decodes) != len(decodes)
            or not ModelLayerOps.keeps(buf.h.shape[0])  # built once, run often
            or not step_program.available()
        ):
            return None
        kept = self._kept.get(buf)
        program = None
        if kept is not None and kept[0] is linears:
            if kept[1] is None:  # these calls have no native form
                return None
            if kept[1].fits(native_decodes):
                program = kept[1]
        if program is None:
            try:
                program = LayerProgram(buf, linears, native_decodes, (cache.k, cache.v))
            except InvalidRequestError as exc:
                logger.debug("layer loop stays in Python: %s", exc)
            self._kept[buf] = (linears, program)
            if program is None:
                return None
        program.set_step(native_decodes, cache.k[0], cache.v[0], buf.out)
        return program
