"""Linear layers bound to a step's buffers (models/bound_linears.py, bound_call.py).

The properties pinned: a bound call writes into the step's buffer the bits ``linear_into``
computes, for every layer type and at 1 and 2 threads (the kernels' thread splits); a whole
decode run of a float32, an int8 and a bf16-weight model gives the same log-probabilities with
the bound calls as with ``linear_into``; a replaced layer or a new thread count re-binds."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from pathlib import Path

import pytest
import torch

from differential.gguf_files import write_tiny_gguf
from pagedkv.engine import bf16_linear, gguf_q8act, layer_ops, qlinear
from pagedkv.engine.bound_call import BoundKernel
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.gguf_qlinear import GGUFProjection
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.loader import load_model
from pagedkv.engine.models import bound_linears
from pagedkv.engine.models.projection import Bf16Projection, Linear, Projection, linear_into
from pagedkv.engine.qlinear import QuantizedProjection
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model
from unit.test_gguf_qlinear import random_projection

pytestmark = pytest.mark.skipif(
    not (layer_ops.available() and qlinear.available() and bf16_linear.available()),
    reason=(
        "native kernels unavailable: "
        f"layer ops {layer_ops.unavailable_reason()}, int8 {qlinear.available()}, "
        f"bf16 {bf16_linear.unavailable_reason()}"
    ),
)


def _layers(in_dim: int, out_dim: int) -> dict[str, Linear]:
    gen = torch.Generator().manual_seed(in_dim * 7 + out_dim)
    w = torch.randn(in_dim, out_dim, generator=gen) / in_dim**0.5
    b = torch.randn(out_dim, generator=gen)
    return {
        "fp32": Projection(w, None),
        "fp32 bias": Projection(w, b),
        "fp32 few-rows": Projection(w, None, few_rows=True),
        "bf16": Bf16Projection.from_weight_t(w.bfloat16(), None),
        "bf16 bias": Bf16Projection.from_weight_t(w.bfloat16(), b),
        "int8": QuantizedProjection.from_float(w, None),
        "int8 bias": QuantizedProjection.from_float(w, b),
        **_gguf_layers(in_dim, out_dim, b),
    }


def _gguf_layers(in_dim: int, out_dim: int, b: torch.Tensor) -> dict[str, Linear]:
    """GGUF blocks (Q4_1, Q8_0) with float32 and with 8-bit activations (the latter on
    ``packed16`` where the build has the 16-output layout), with and without a bias."""
    layers: dict[str, Linear] = {}
    for t in ("Q4_1", "Q8_0"):
        p = random_projection(t, out_dim, in_dim, seed=in_dim + out_dim)
        for acts in ("float32", "int8"):
            for bias in (None, b):
                name = f"gguf {t} {acts}{'' if bias is None else ' bias'}"
                layers[name] = GGUFProjection(t, p.blocks, in_dim, bias, acts)
    return layers


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("in_dim", "out_dim"), [(64, 96), (1024, 4096)])  # one call; split
def test_bound_call_writes_linear_intos_bits(
    threads: int, rows: int, in_dim: int, out_dim: int
) -> None:
    x = torch.randn(rows, in_dim, generator=torch.Generator().manual_seed(rows))
    for name, p in _layers(in_dim, out_dim).items():
        out = torch.full((rows, out_dim), float("nan"))
        call = bound_linears.bind_into(p, x, out)
        assert call() is out, name
        assert torch.equal(out, linear_into(p, x, torch.empty(rows, out_dim))), name
        # what each layer type binds to: a prebuilt kernel call, torch.mm, or linear_into
        if name.startswith(("bf16", "int8", "gguf")):
            assert isinstance(call, BoundKernel), name
        elif name == "fp32 few-rows" and rows > 1:  # the few-row kernel's rows
            assert isinstance(call, partial), name
            assert call.func is linear_into, name
        else:
            assert isinstance(call, partial), name
            assert call.func in (torch.mm, torch.addmm), name


def test_a_stub_subclass_and_a_mismatched_buffer_keep_linear_into() -> None:
    class Stub(Projection):
        __slots__ = ()

        def into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
            return out.zero_()

    w = torch.randn(8, 16)
    x = torch.randn(1, 8)
    stub = bound_linears.bind_into(Stub(w, None), x, torch.ones(1, 16))
    assert isinstance(stub, partial)
    assert stub.func is linear_into
    assert torch.count_nonzero(stub()) == 0  # the subclass's own into ran
    strided = torch.empty(16, 2).t()  # [2, 16], not contiguous: no int8 prebuilt call
    q = bound_linears.bind_into(QuantizedProjection.from_float(w, None), x.repeat(2, 1), strided)
    assert isinstance(q, partial)
    assert q.func is linear_into


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("bound") / "m", hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, eos_token_id=None,
    )  # fmt: skip


def _logprobs(engine: LLMEngine) -> list[tuple[int, float]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    engine.add_request("r", [5, 9, 14, 3, 22, 7], params)
    got: list[tuple[int, float]] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got = [(t.token_id, t.logprob) for t in out.outputs[0].logprobs or ()]
    return got


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", None), ("float32", "int8"), ("bfloat16", None)]
)
def test_a_decode_run_is_the_same_with_and_without_bound_calls(
    model_dir: Path, dtype: str, quantization: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = EngineConfig(num_blocks=64, dtype=dtype, quantization=quantization)
    bound = LLMEngine.from_model_dir(str(model_dir), cfg)
    assert bound.model.fused_layer_ops
    ours = _logprobs(bound)
    kinds = {type(c) for layer in next(iter(bound.model._bound.values())).calls for c in layer}
    assert kinds == ({partial} if dtype == "float32" and quantization is None else {BoundKernel})
    monkeypatch.setattr(bound_linears, "bind_into", partial(partial, linear_into))
    unbound = LLMEngine.from_model_dir(str(model_dir), cfg)
    assert _logprobs(unbound) == ours  # token ids and log-probabilities, bit for bit


@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_a_gguf_decode_run_is_the_same_with_and_without_bound_calls(
    tmp_path: Path, activations: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny Q4_1 GGUF with its blocks kept (``--quantization gguf``, float32 or 8-bit
    activations): every linear call is a prebuilt kernel call, and the tokens and
    log-probabilities equal those of ``linear_into`` everywhere."""
    if activations == "int8" and gguf_q8act._native.load() is None:
        pytest.skip("no int8-activation kernel")
    path, _ = write_tiny_gguf(tmp_path, tensor_type="Q4_1")
    cfg = EngineConfig(num_blocks=64, quantization="gguf", gguf_activations=activations)
    bound = LLMEngine.from_model_dir(str(path), cfg)
    assert bound.model.fused_layer_ops
    ours = _logprobs(bound)
    kinds = {type(c) for layer in next(iter(bound.model._bound.values())).calls for c in layer}
    assert kinds == {BoundKernel}
    monkeypatch.setattr(bound_linears, "bind_into", partial(partial, linear_into))
    unbound = LLMEngine.from_model_dir(str(path), cfg)
    assert _logprobs(unbound) == ours  # token ids and log-probabilities, bit for bit


def test_replacing_a_layer_or_the_thread_count_binds_again(model_dir: Path) -> None:
    model = load_model(model_dir, dtype="float32")
    engine = LLMEngine(model, None, EngineConfig(num_blocks=64))
    first = _logprobs(engine)
    (buf, bound), *_ = model._bound.items()
    groups = (model._qkv, model._o, model._gate_up, model._down)
    assert bound.fits(groups)
    old = model._o[0]
    assert isinstance(old, Projection)
    model._o[0] = replace(old, weight_t=torch.zeros_like(old.weight_t))  # o-proj of layer 0 off
    assert not bound.fits(groups)
    changed = _logprobs(engine)
    assert changed != first  # the new layer ran: a stale bound call would repeat `first`
    model._o[0] = old
    before = torch.get_num_threads()
    torch.set_num_threads(1 if before > 1 else 2)
    try:
        assert not model._bound[buf].fits(groups)
    finally:
        torch.set_num_threads(before)
    assert _logprobs(engine) == first
