"""The SwiGLU MLP in one AMX call (``bf16_dot.mlp``, ``csrc/bf16_dot.c``): the bits of the three
calls it replaces (gate/up, torch's SiLU on the gate half, the gated down projection) at any
row count, shape and thread count; its refusals; and a medium engine whose Python layer loop
takes it giving the tokens and log-probabilities it gave without it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from differential.engine_runs import greedy_logprobs
from pagedkv.engine import bf16_dot
from pagedkv.engine.bf16_dot import PairedWeight
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.models import bound_linears, tiled_layers
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.errors import InvalidRequestError

needs_mlp = pytest.mark.skipif(
    not bf16_dot.mlp_ready(), reason="no AMX-BF16, or torch without its AVX-512 exp"
)


def _weights(hidden: int, inter: int, gen: torch.Generator) -> tuple[PairedWeight, PairedWeight]:
    gate_up = torch.randn(hidden, 2 * inter, generator=gen) / hidden**0.5
    down = torch.randn(inter, hidden, generator=gen) / inter**0.5
    return (
        PairedWeight.from_weight_t(gate_up.to(torch.bfloat16)),
        PairedWeight.from_weight_t(down.to(torch.bfloat16)),
    )


def _three_calls(x: torch.Tensor, gate_up: PairedWeight, down: PairedWeight) -> torch.Tensor:
    """What the layer loop does without the MLP call: gate/up, torch's SiLU in place on the
    gate half, then the down projection multiplying gate by up as it packs."""
    inter = down.in_features
    gu = bf16_dot.linear(x, gate_up)
    gate, up = gu[:, :inter], gu[:, inter:]
    torch._C._nn.silu_(gate)
    return bf16_dot.linear(gate, down, up=up)


@needs_mlp
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("hidden", "inter"),
    [(64, 96), (96, 160), (128, 32), (576, 1536)],
    ids=["64x96", "96x160", "128x32", "smollm2"],
)
def test_the_mlp_gives_the_bits_of_its_three_calls(hidden: int, inter: int, threads: int) -> None:
    """Every row count (one, below a tile, a tile and one, several blocks with a partial
    last one), each row also alone: the same bits as the three calls, bound or not."""
    gen = torch.Generator().manual_seed(hidden * 31 + inter)
    gate_up, down = _weights(hidden, inter, gen)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in (1, 3, 16, 17, 33, 100):
            x = torch.randn(rows, hidden, generator=gen) * 3
            want = _three_calls(x, gate_up, down)
            assert torch.equal(bf16_dot.mlp(x, gate_up, down), want), rows
            assert torch.equal(bf16_dot.mlp(x[-1:], gate_up, down), want[-1:]), rows
            out = torch.empty(rows, hidden)
            bound = bf16_dot.bind_mlp(x, gate_up, down, out)
            assert bound is not None
            assert bound() is out
            assert torch.equal(out, want), rows
    finally:
        torch.set_num_threads(before)


@needs_mlp
@pytest.mark.parametrize("rows", [768, 800, 777])
def test_a_prefill_sized_mlp_cuts_its_rows_among_the_threads_with_the_same_bits(
    rows: int,
) -> None:
    """From 384 rows a thread (``BD_ROWS_MLP``) each thread runs its own rows' gate/up, SiLU
    and down (777: a partial last block): the bits of one thread and of the three calls."""
    gen = torch.Generator().manual_seed(rows)
    gate_up, down = _weights(64, 96, gen)
    x = torch.randn(rows, 64, generator=gen) * 3
    one = bf16_dot.mlp(x, gate_up, down, threads=1)
    assert torch.equal(bf16_dot.mlp(x, gate_up, down, threads=2), one)
    assert torch.equal(_three_calls(x, gate_up, down), one)


@needs_mlp
def test_padding_past_the_intermediate_size_stays_zero() -> None:
    """An intermediate size that is an odd multiple of 16 leaves half of the down
    projection's last k step as padding, and a row count that is not a multiple of 16 leaves
    padding rows: neither reaches an output, whatever the heap held before (reused memory
    full of NaN is put there first)."""
    gen = torch.Generator().manual_seed(7)
    gate_up, down = _weights(64, 48, gen)
    for _ in range(3):  # leave NaN-filled blocks on the heap for the kernel's buffers
        torch.full((4096 * 64,), float("nan")).sum()
    x = torch.randn(21, 64, generator=gen)
    got = bf16_dot.mlp(x, gate_up, down)
    assert bool(torch.isfinite(got).all())
    assert torch.equal(got, _three_calls(x, gate_up, down))


@needs_mlp
def test_bad_shapes_are_refused_with_a_typed_error() -> None:
    gen = torch.Generator().manual_seed(3)
    gate_up, down = _weights(64, 96, gen)
    with pytest.raises(InvalidRequestError, match="float32 CPU input"):
        bf16_dot.mlp(torch.randn(2, 63), gate_up, down)
    odd_up, odd_down = _weights(64, 40, gen)  # 40 is not a multiple of 16
    with pytest.raises(InvalidRequestError, match=r"a multiple of 16"):
        bf16_dot.mlp(torch.randn(2, 64), odd_up, odd_down)
    with pytest.raises(InvalidRequestError, match=r"gate/up \[64, 192\] and down \[40, 64\]"):
        bf16_dot.mlp(torch.randn(2, 64), gate_up, odd_down)
    assert bf16_dot.bind_mlp(torch.randn(2, 64), odd_up, odd_down, torch.empty(2, 64)) is None
    assert bf16_dot.bind_mlp(torch.randn(2, 64), gate_up, down, torch.empty(3, 64)) is None
    assert bf16_dot.mlp(torch.empty(0, 64), gate_up, down).shape == (0, 64)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("bf16mlp") / "m", hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, eos_token_id=None,
    )  # fmt: skip


@needs_mlp
def test_a_medium_engine_gives_the_same_outputs_with_and_without_the_mlp_call(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts prefilled whole and in chunks, then decoded: the same greedy tokens and
    log-probabilities, bit for bit, when the layer loop (and the decode programs) take the
    one-call MLP as when they make the three calls. The loop's tiled form is switched off in
    both runs, so that the prefill steps take the float32-input MLP call too."""
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (1, 7, 40, 130)]

    def run(with_mlp: bool, chunk: int) -> list[list[tuple[int, float]]]:
        monkeypatch.setattr(tiled_layers.TiledLayers, "build", lambda *a: None)
        if not with_mlp:
            monkeypatch.setattr(bound_linears, "_bind_mlp", lambda *a: None)
        cfg = EngineConfig(num_blocks=128, dtype="bfloat16", matmul_precision="medium",
                           max_num_batched_tokens=chunk, max_num_seqs=8,
                           enable_prefix_caching=False)  # fmt: skip
        engine = LLMEngine.from_model_dir(str(model_dir), cfg)
        got, _ = greedy_logprobs(engine, prompts)
        bound = list(engine.model._bound.values())
        assert bound
        assert all(all(m is not None for m in b.mlp) == with_mlp for b in bound)
        monkeypatch.undo()
        return got

    for chunk in (2048, 48):  # whole prompts, and chunks of at most 48 tokens
        assert run(True, chunk) == run(False, chunk)
