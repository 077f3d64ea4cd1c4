"""Norms that write bf16 A tiles and AMX linears that read them (``csrc/bf16_tiles.h``,
``layer_ops``' ``pagedkv_add_rms_norm_tiles``, ``bf16_dot.bind_linear_tiles`` and
``bind_mlp_tiles``, ``models.tiled_layers``): the tiles are the float32 norm's rows rounded as
the packing rounds them, the linears over them give the bits of the float32 path, and a medium
engine whose layer loop takes them gives the tokens and log-probabilities it gave without."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from differential.engine_runs import greedy_logprobs
from pagedkv.engine import bf16_dot, layer_ops
from pagedkv.engine.bf16_dot import PairedWeight
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.models import llama, tiled_layers
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model

needs_amx = pytest.mark.skipif(not bf16_dot.amx(), reason="this CPU has no AMX-BF16")
needs_mlp = pytest.mark.skipif(
    not bf16_dot.mlp_ready(), reason="no AMX-BF16, or torch without its AVX-512 exp"
)
EPS = 1e-5


def _as_tiles(x: torch.Tensor) -> torch.Tensor:
    """``x`` [rows, in] (float32) rounded to bf16 by torch and laid out as A tiles, zero padded
    (``csrc/bf16_tiles.h``): the reference layout, built with torch ops."""
    rows, in_dim = x.shape
    rp, kp = -(-rows // 16) * 16, bf16_dot.tiles_k(in_dim)
    padded = torch.zeros(rp, kp, dtype=torch.bfloat16)
    padded[:rows, :in_dim] = x.to(torch.bfloat16)
    return padded.view(rp // 16, 16, kp // 32, 32).permute(0, 2, 1, 3).reshape(-1)


def _norm_tiles(h: torch.Tensor, delta: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    rows, d = h.shape
    tiles = torch.full((bf16_dot.tiles_for(rows, d).numel(),), float("nan"), dtype=torch.bfloat16)
    code = layer_ops.library().pagedkv_add_rms_norm_tiles(
        h.data_ptr(), delta.data_ptr(), d, w.data_ptr(), tiles.data_ptr(),
        bf16_dot.tiles_k(d), rows, d, EPS, layer_ops.vector_width(),
    )  # fmt: skip
    assert code == 0
    return tiles


@pytest.mark.parametrize(("rows", "d"), [(1, 64), (17, 80), (40, 96), (100, 576), (2048, 576)])
def test_the_tiled_norm_is_the_float_norm_rounded_and_laid_out(rows: int, d: int) -> None:
    """``h += delta`` as the float32 norm does it, and tiles equal to the float32 norm's rows
    rounded to bf16 (torch's rounding: nearest even) in the A-tile layout, padding zero."""
    gen = torch.Generator().manual_seed(rows * d)
    h = torch.randn(rows, d, generator=gen) * 3
    delta, w = torch.randn(rows, d, generator=gen), torch.randn(d, generator=gen)
    h_ref, x_ref = h.clone(), torch.empty(rows, d)
    layer_ops.add_rms_norm(h_ref, delta, w, EPS, x_ref)
    tiles = _norm_tiles(h, delta, w)
    assert torch.equal(h, h_ref)
    assert torch.equal(tiles, _as_tiles(x_ref))


@needs_amx
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("rows", "in_dim", "out_dim"), [(1, 64, 48), (33, 80, 160), (70, 576, 960)]
)
def test_a_linear_over_tiles_gives_the_bits_of_the_float_input(
    rows: int, in_dim: int, out_dim: int, threads: int
) -> None:
    gen = torch.Generator().manual_seed(rows + in_dim)
    p = PairedWeight.from_weight_t(torch.randn(in_dim, out_dim, generator=gen).to(torch.bfloat16))
    bias = torch.randn(out_dim, generator=gen)
    x = torch.randn(rows, in_dim, generator=gen) * 2
    out = torch.empty(rows, out_dim)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        bound = bf16_dot.bind_linear_tiles(_as_tiles(x), rows, p, bias, out)
        assert bound is not None
        assert bound() is out
        assert torch.equal(out, bf16_dot.linear(x, p, bias))
    finally:
        torch.set_num_threads(before)
    assert bf16_dot.bind_linear_tiles(_as_tiles(x)[16:], rows, p, bias, out) is None  # short


@needs_mlp
@pytest.mark.parametrize(("rows", "hidden", "inter"), [(1, 64, 96), (33, 96, 160), (70, 576, 1536)])
def test_an_mlp_over_tiles_gives_the_bits_of_the_float_input(
    rows: int, hidden: int, inter: int
) -> None:
    gen = torch.Generator().manual_seed(rows + hidden)
    gate_up = PairedWeight.from_weight_t(
        (torch.randn(hidden, 2 * inter, generator=gen) / hidden**0.5).to(torch.bfloat16)
    )
    down = PairedWeight.from_weight_t(
        (torch.randn(inter, hidden, generator=gen) / inter**0.5).to(torch.bfloat16)
    )
    x = torch.randn(rows, hidden, generator=gen) * 2
    out = torch.empty(rows, hidden)
    bound = bf16_dot.bind_mlp_tiles(_as_tiles(x), rows, gate_up, down, out)
    assert bound is not None
    assert bound() is out
    assert torch.equal(out, bf16_dot.mlp(x, gate_up, down))


@needs_mlp
@pytest.mark.parametrize(
    ("hidden", "inter", "heads", "kv_heads"),
    [(128, 96, 4, 2), (64, 96, 4, 4), (80, 112, 4, 4)],
    ids=["head-dim-32", "head-dim-16", "80-padded"],
)
def test_a_medium_engine_gives_the_same_outputs_with_and_without_the_tiles(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hidden: int, inter: int, heads: int,
    kv_heads: int,
) -> None:  # fmt: skip
    """Prompts prefilled whole and in chunks, then decoded: the same greedy tokens and
    log-probabilities, bit for bit, when the layer loop passes the norms' outputs as tiles
    as when it passes float32 rows; with a head_dim of 32 the AMX prompt kernel writes the o
    projection's tiles too (checked: ``attend_tiles`` serves layers), with 16 it cannot (the
    o projection reads float32 rows); a hidden size of 80 pads the tiles to 96."""
    model_dir = write_tiny_model(
        tmp_path / "m", hidden_size=hidden, intermediate_size=inter, num_hidden_layers=3,
        num_attention_heads=heads, num_key_value_heads=kv_heads, eos_token_id=None,
    )  # fmt: skip
    served: list[bool] = []
    attend_tiles = llama.attend_tiles

    def spy_attend(*args: object) -> bool:
        served.append(attend_tiles(*args))  # type: ignore[arg-type]
        return served[-1]

    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=gen).tolist() for n in (1, 9, 70, 150)]
    built: list[bool] = []
    build = tiled_layers.TiledLayers.build

    def run(tiles: bool, chunk: int) -> list[list[tuple[int, float]]]:
        def spy(buf: object, linears: object) -> object:
            made = build(buf, linears) if tiles else None  # type: ignore[arg-type]
            built.append(made is not None)
            return made

        monkeypatch.setattr(tiled_layers.TiledLayers, "build", spy)
        monkeypatch.setattr(llama, "attend_tiles", spy_attend)
        cfg = EngineConfig(num_blocks=128, dtype="bfloat16", matmul_precision="medium",
                           max_num_batched_tokens=chunk, max_num_seqs=8,
                           enable_prefix_caching=False)  # fmt: skip
        got, _ = greedy_logprobs(LLMEngine.from_model_dir(str(model_dir), cfg), prompts)
        monkeypatch.undo()
        return got

    for chunk in (2048, 48):  # whole prompts, and chunks of at most 48 tokens
        built.clear()
        want = run(False, chunk)
        assert built
        assert not any(built)
        built.clear()
        assert run(True, chunk) == want
        assert built
        assert all(built)
    assert any(served) == (hidden // heads == 32)


@needs_mlp
def test_a_prefills_tiled_calls_do_not_outlive_its_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The model keeps each step's bound calls in a dictionary keyed weakly by the step's
    buffers: prefills of many sizes (buffers not kept) leave no entry behind, so nothing in
    the tiled calls holds the buffers (each such entry held tens of MB at 1,024 tokens)."""
    model_dir = write_tiny_model(
        tmp_path / "m", hidden_size=128, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=None,
    )  # fmt: skip
    engine = LLMEngine.from_model_dir(str(model_dir), EngineConfig(
        num_blocks=256, dtype="bfloat16", matmul_precision="medium", enable_prefix_caching=False,
    ))  # fmt: skip
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    built: list[bool] = []
    build = tiled_layers.TiledLayers.build

    def spy(buf: object, linears: object) -> object:
        made = build(buf, linears)  # type: ignore[arg-type]
        built.append(made is not None)
        return made

    monkeypatch.setattr(tiled_layers.TiledLayers, "build", spy)
    for n in range(100, 300, 40):  # prefill steps of more rows than the kept buffers'
        engine.add_request(f"r{n}", [3 + i % 250 for i in range(n)], one)
        while engine.has_unfinished_requests():
            engine.step()
    gc.collect()
    assert len(built) == 5
    assert all(built)
    assert len(engine.model._bound) == 0
