"""bf16 arithmetic on AMX (engine/bf16_dot.py, csrc/bf16_dot.c; ``matmul_precision``): the
pair-tile layout packing and unpacking exactly, the activations rounded as torch rounds them,
both paths (AMX where it runs, the portable loops anywhere) within the stated bound of the
exact sum over the rounded inputs, batch and thread invariance, and the engine option: its
refusals, its fallback where AMX does not run, its cache namespace, and prefix caching giving
the same bits under it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from differential.engine_runs import greedy_logprobs
from pagedkv.engine import attention, bf16_dot, bf16_linear, prompt_attention
from pagedkv.engine.bf16_dot import PairedWeight
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.loader import load_model
from pagedkv.engine.model_args import engine_config
from pagedkv.engine.models.projection import Bf16DotProjection, Bf16Projection
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.errors import InvalidRequestError
from pagedkv.server import cli as serve_cli

built = pytest.mark.skipif(bf16_dot._native.load() is None, reason="no C compiler")
needs_amx = pytest.mark.skipif(not bf16_dot.amx(), reason="this CPU has no AMX-BF16")
EPS = 2.0**-24
PATHS = [pytest.param(True, id="portable"), pytest.param(False, id="amx", marks=needs_amx)]


def _bf16(*shape: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(torch.bfloat16)


def _check_bound(
    y: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor, bias: torch.Tensor | None
) -> None:
    """``y`` within ``(kp + 2) * eps * (|xb| @ |W|)`` (+ the bias's rounding) of the exact
    sum over the bf16-rounded inputs ``xb`` (torch's round to nearest even)."""
    xb = x.to(torch.bfloat16).double()
    ref = xb @ w_t.double()
    mag = xb.abs() @ w_t.double().abs()
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    kp = -(-x.shape[1] // 32) * 32
    err = (y.double() - ref).abs()
    bound = (kp + 2) * EPS * mag + 1e-30
    assert bool((err <= bound).all()), float((err - bound).max())


@built
@pytest.mark.parametrize(("in_dim", "out_dim"), [(1, 1), (31, 17), (32, 16), (77, 203), (96, 48)])
def test_pair_tiles_pack_and_unpack_exactly(in_dim: int, out_dim: int) -> None:
    gen = torch.Generator().manual_seed(in_dim + out_dim)
    w_t = _bf16(in_dim, out_dim, gen=gen)
    p = PairedWeight.from_weight_t(w_t)
    assert tuple(p.tiles.shape) == (-(-out_dim // 16), -(-in_dim // 32) * 16, 16, 2)
    assert torch.equal(p.weight_t(), w_t)
    assert torch.equal(p.tiled().weight_t(), w_t)
    assert torch.equal(
        PairedWeight.from_tiled(bf16_linear.TiledWeight.from_weight_t(w_t)).tiles, p.tiles
    )
    full = p.tiles.permute(1, 3, 0, 2).reshape(p.tiles.shape[1] * 2, -1)
    assert int(full.count_nonzero()) == int(w_t.count_nonzero())  # the padding is zeros


@built
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize(("in_dim", "out_dim"), [(5, 3), (32, 16), (77, 203), (130, 40)])
def test_linear_is_within_the_bound_of_the_rounded_inputs(
    portable: bool, in_dim: int, out_dim: int
) -> None:
    gen = torch.Generator().manual_seed(in_dim * 1000 + out_dim)
    w_t = _bf16(in_dim, out_dim, gen=gen)
    bias = torch.randn(out_dim, generator=gen)
    p = PairedWeight.from_weight_t(w_t)
    for rows in (1, 2, 15, 16, 17, 32, 33, 70):
        x = torch.randn(rows, in_dim, generator=gen)
        _check_bound(bf16_dot.linear(x, p, bias, portable=portable), x, w_t, bias)
        _check_bound(bf16_dot.linear(x, p, portable=portable), x, w_t, None)


@built
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize(("vocab", "in_dim"), [(16, 32), (37, 64), (203, 96)])
def test_linear_nt_is_within_the_bound_of_the_rounded_inputs(
    portable: bool, vocab: int, in_dim: int
) -> None:
    gen = torch.Generator().manual_seed(vocab + in_dim)
    e = _bf16(vocab, in_dim, gen=gen)
    for rows in (1, 3, 16, 17, 40):
        x = torch.randn(rows, in_dim, generator=gen)
        _check_bound(bf16_dot.linear_nt(x, e, portable=portable), x, e.t(), None)


@built
@pytest.mark.parametrize("portable", PATHS)
def test_the_inputs_round_to_nearest_even_as_torch_rounds_them(portable: bool) -> None:
    """Through an identity weight each output is one exact product: the rounded input. Ties
    (halfway between two bf16 values) go to the even one, as torch's conversion; below bf16's
    smallest normal an input flushes to a signed zero; a NaN input makes every output NaN
    (it meets the identity's zeros), and an infinity sums to an infinity."""
    one = 1.0 + 2.0**-8  # halfway between 1 and the next bf16 (1 + 2^-7): ties to 1
    three = 1.0 + 3 * 2.0**-8  # halfway between 1 + 2^-7 and 1 + 2^-6: ties to 1 + 2^-6
    special = [one, -one, three, 1.0 + 2.0**-8 + 2.0**-20, 3.0e38, -0.0, 1e-3, -5e-37]
    gen = torch.Generator().manual_seed(3)
    x = torch.cat([torch.tensor(special), torch.randn(32 - len(special), generator=gen)])[None]
    eye = PairedWeight.from_weight_t(torch.eye(32, dtype=torch.bfloat16))
    assert torch.equal(bf16_dot.linear(x, eye, portable=portable), x.to(torch.bfloat16).float())
    tiny = torch.zeros(1, 32)
    tiny[0, 3] = -1e-39  # subnormal: torch keeps it in bf16, the kernel reads a zero
    assert torch.equal(bf16_dot.linear(tiny, eye, portable=portable), torch.zeros(1, 32))
    nan = torch.zeros(1, 32)
    nan[0, 0] = float("nan")
    assert bool(bf16_dot.linear(nan, eye, portable=portable).isnan().all())
    ones = PairedWeight.from_weight_t(torch.ones(32, 4, dtype=torch.bfloat16))
    inf = torch.ones(2, 32)
    inf[0, 5], inf[1, 7] = float("inf"), -float("inf")
    y = bf16_dot.linear(inf, ones, portable=portable)
    assert bool((y[0] == float("inf")).all())
    assert bool((y[1] == -float("inf")).all())


@needs_amx
def test_a_rows_bits_depend_neither_on_its_batch_nor_on_the_threads() -> None:
    gen = torch.Generator().manual_seed(11)
    w_t, bias, e = _bf16(96, 203, gen=gen), torch.randn(203, generator=gen), _bf16(203, 96, gen=gen)
    p = PairedWeight.from_weight_t(w_t)
    x = torch.randn(70, 96, generator=gen)  # 1, 16, 32 and 70-row calls: every block shape
    full, full_nt = bf16_dot.linear(x, p, bias, threads=1), bf16_dot.linear_nt(x, e, threads=1)
    for r0, r1 in ((0, 1), (5, 6), (3, 19), (0, 32), (40, 70), (1, 70)):
        assert torch.equal(bf16_dot.linear(x[r0:r1], p, bias), full[r0:r1]), (r0, r1)
        assert torch.equal(bf16_dot.linear_nt(x[r0:r1], e), full_nt[r0:r1]), (r0, r1)
    assert torch.equal(bf16_dot.linear(x, p, bias, threads=2), full)
    assert torch.equal(bf16_dot.linear_nt(x, e, threads=2), full_nt)
    out = torch.empty(70, 203)
    assert bf16_dot.linear(x, p, bias, out) is out
    assert torch.equal(out, full)


@needs_amx
@pytest.mark.parametrize("rows", [256, 300])
def test_a_prefill_sized_call_cuts_its_rows_among_the_threads_with_the_same_bits(
    rows: int,
) -> None:
    """From 128 rows a thread (``BD_ROWS_LINEAR``) the rows, not the columns, are cut among
    the threads, in whole 32-row blocks (300: a partial last one): the bits of one thread, and
    of each row alone."""
    gen = torch.Generator().manual_seed(rows)
    p = PairedWeight.from_weight_t(_bf16(96, 203, gen=gen))
    bias, x = torch.randn(203, generator=gen), torch.randn(rows, 96, generator=gen)
    one = bf16_dot.linear(x, p, bias, threads=1)
    assert torch.equal(bf16_dot.linear(x, p, bias, threads=2), one)
    for r in (0, 31, 32, 127, 128, 150, rows - 1):
        assert torch.equal(bf16_dot.linear(x[r : r + 1], p, bias, threads=2), one[r : r + 1])


@built
@pytest.mark.parametrize("portable", PATHS)
@pytest.mark.parametrize(("rows", "in_dim"), [(1, 64), (5, 77), (16, 96), (37, 130), (70, 96)])
def test_a_gated_call_gives_the_bits_of_torch_mul_then_linear(
    portable: bool, rows: int, in_dim: int
) -> None:
    """``linear(g, W, up=u)`` over the two halves of one gate/up buffer (row-strided views)
    is ``linear(g * u, W)`` bit for bit: the product is torch.mul's float32 one, rounded to
    bf16 as any input is; bound or not, alone or in a batch."""
    gen = torch.Generator().manual_seed(rows * 1000 + in_dim)
    p = PairedWeight.from_weight_t(_bf16(in_dim, 48, gen=gen))
    bias = torch.randn(48, generator=gen)
    gu = torch.randn(rows, 2 * in_dim, generator=gen) * 4
    g, u = gu[:, :in_dim], gu[:, in_dim:]
    want = bf16_dot.linear(torch.mul(g, u), p, bias, portable=portable)
    assert torch.equal(bf16_dot.linear(g, p, bias, up=u, portable=portable), want)
    assert torch.equal(bf16_dot.linear(g[1:], p, bias, up=u[1:], portable=portable), want[1:])
    if not portable:
        out = torch.empty(rows, 48)
        bound = bf16_dot.bind_into(g, p, bias, out, up=u)
        assert bound is not None
        assert bound() is out
        assert torch.equal(out, want)
    with pytest.raises(InvalidRequestError, match="row stride"):
        bf16_dot.linear(g, p, up=u[:, 1:], portable=portable)


@needs_amx
@pytest.mark.parametrize("rows", [1, 3, 40])
def test_medium_gated_down_gives_the_torch_ops_bits(model_dir: Path, rows: int) -> None:
    """The fused forward's down projections multiply gate by up themselves (``gated``): its
    hidden states are the bits of the torch-ops forward, which multiplies with torch.mul."""
    cfg = EngineConfig(num_blocks=64, dtype="bfloat16", matmul_precision="medium")
    prompts = [[5 + r, 9, 14, 3 + r % 7, 22][: 2 + r % 4] for r in range(rows)]

    def run(fused: bool) -> list[list[tuple[int, float]]]:
        engine = LLMEngine.from_model_dir(str(model_dir), cfg)
        engine.model.fused_layer_ops = fused
        got, _ = greedy_logprobs(engine, prompts)
        if fused:
            assert all(next(iter(engine.model._bound.values())).gated)
        return got

    assert run(True) == run(False)


@built
def test_bad_inputs_are_refused_with_a_typed_error() -> None:
    gen = torch.Generator().manual_seed(1)
    p = PairedWeight.from_weight_t(_bf16(32, 16, gen=gen))
    with pytest.raises(InvalidRequestError, match="float32 CPU input"):
        bf16_dot.linear(torch.randn(2, 31), p, portable=True)
    with pytest.raises(InvalidRequestError, match="float32 CPU input"):
        bf16_dot.linear(torch.randn(2, 32).double(), p, portable=True)
    with pytest.raises(InvalidRequestError, match="bias"):
        bf16_dot.linear(torch.randn(2, 32), p, torch.randn(15), portable=True)
    with pytest.raises(InvalidRequestError, match="multiple of 32"):
        bf16_dot.linear_nt(torch.randn(2, 33), _bf16(16, 33, gen=gen), portable=True)
    with pytest.raises(InvalidRequestError, match="pair tiles"):
        PairedWeight(torch.zeros(1, 16, 16, 2, dtype=torch.bfloat16), 33, 16)
    with pytest.raises(InvalidRequestError, match="pair tiles"):
        PairedWeight.from_weight_t(torch.randn(32, 16))
    assert bf16_dot.linear(torch.randn(0, 32), p).shape == (0, 16)  # no rows: no call, no error
    assert bf16_dot.linear_nt(torch.randn(0, 32), _bf16(16, 32, gen=gen)).shape == (0, 16)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"matmul_precision": "low"}, "must be one of highest, medium"),
        ({"matmul_precision": "medium"}, "needs bfloat16 weights"),  # dtype auto: float32
        ({"matmul_precision": "medium", "dtype": "float32"}, "needs bfloat16 weights"),
        ({"matmul_precision": "medium", "dtype": "bfloat16", "device": "cuda"}, "CPU only"),
    ],
)
def test_the_engine_option_is_refused_where_it_cannot_apply(
    kwargs: dict[str, str], match: str
) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


def test_the_flag_reaches_the_engine_config() -> None:
    parser = serve_cli.build_parser()
    args = parser.parse_args(["m", "--dtype", "bfloat16", "--matmul-precision", "medium"])
    assert engine_config(parser, args).matmul_precision == "medium"
    assert engine_config(parser, parser.parse_args(["m"])).matmul_precision == "highest"
    with pytest.raises(SystemExit):  # medium over float32 weights: a usage error
        engine_config(parser, parser.parse_args(["m", "--matmul-precision", "medium"]))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("bf16dot") / "m", hidden_size=64, intermediate_size=96,
        num_hidden_layers=2, eos_token_id=None,
    )  # fmt: skip


@built
def test_medium_repacks_the_layers_and_names_its_cache_namespace(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Where AMX runs, ``medium`` swaps every bf16 layer for its AMX twin, and the KV it writes
    is its own namespace; switching back repacks exactly (the same bits as a fresh engine).
    Elsewhere it stays ``highest``, says so, and the namespace does not change."""
    prompts = [[5, 9, 14, 3, 22, 7], [40, 2, 8, 8, 31]]
    base = EngineConfig(num_blocks=32, dtype="bfloat16", model_id="m")
    with caplog.at_level(logging.WARNING):
        engine = LLMEngine.from_model_dir(str(model_dir), EngineConfig(
            num_blocks=32, dtype="bfloat16", model_id="m", matmul_precision="medium"
        ))  # fmt: skip
    model = engine.model
    layers = [p for g in (model._qkv, model._o, model._gate_up, model._down) for p in g]
    if not bf16_dot.amx():
        assert model.matmul_precision == "highest"
        assert "runs as 'highest'" in caplog.text
        assert engine.config.model_id == "m+compute=float32"
        assert all(type(p) is Bf16Projection for p in layers)
        assert model.sdpa_dtype is None
        return
    assert model.matmul_precision == "medium"
    assert model.sdpa_dtype is torch.bfloat16
    assert engine.config.model_id == "m+compute=float32+matmul=medium"
    assert all(type(p) is Bf16DotProjection for p in layers)
    medium, _ = greedy_logprobs(engine, prompts)
    model.set_matmul_precision("highest")
    assert all(type(p) is Bf16Projection for p in (model._qkv + model._down))
    assert model.sdpa_dtype is None
    fresh = LLMEngine.from_model_dir(str(model_dir), base)
    highest, _ = greedy_logprobs(fresh, prompts)
    again = LLMEngine(model, None, base)
    assert greedy_logprobs(again, prompts)[0] == highest  # the repack back is exact
    diffs = [
        abs(a[1] - b[1])
        for m, h in zip(medium, highest, strict=True)
        for a, b in zip(m, h, strict=True)
    ]
    assert max(diffs) < 0.1
    assert medium != highest


@needs_amx
def test_medium_head_copy_gives_the_bits_of_the_embedding_as_stored(model_dir: Path) -> None:
    """Under ``medium`` the vocabulary projection reads its own copy of the weight in B tiles;
    its logits are the bits of the kernel that reads the embedding as stored, at any number
    of rows (so batch invariance holds across both), and within the stated bound. Back to
    ``highest``, the copy is dropped."""
    cfg = EngineConfig(num_blocks=32, dtype="bfloat16", matmul_precision="medium")
    model = LLMEngine.from_model_dir(str(model_dir), cfg).model
    assert model._lm_head_paired is not None
    gen = torch.Generator().manual_seed(9)
    hidden = model.config.hidden_size
    for rows in (1, 3, 5, 16, 33):
        x = torch.randn(rows, hidden, generator=gen)
        got = model.logits(x)
        _check_bound(got, x, model.lm_head.t(), None)
        if bf16_dot.nt_accepts(model.lm_head):
            assert torch.equal(got, bf16_dot.linear_nt(x, model.lm_head))
        assert torch.equal(got[:1], model.logits(x[:1]))  # a row alone: the same bits
    model.set_matmul_precision("highest")
    assert model._lm_head_paired is None


@needs_amx
@pytest.mark.parametrize("fused", [True, False], ids=["layer-ops", "torch-ops"])
def test_medium_prefill_attention_runs_in_bf16(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    """Under ``medium`` the SDPA path (prefill; head_dim 16 is not the AMX prompt kernel's)
    computes in bf16: its queries, keys and values reach torch's SDPA as bf16; under
    ``highest`` as float32 (the float32 prompt kernel switched off here). Decode rows keep the
    float32 kernel either way (no SDPA call)."""
    monkeypatch.setattr(prompt_attention, "available_f32", lambda: False)
    real = attention.F.scaled_dot_product_attention
    seen: list[tuple[torch.dtype, torch.dtype, torch.dtype]] = []

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: object) -> torch.Tensor:
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    prompt = torch.randint(2, 60, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    for precision, dtype in (("medium", torch.bfloat16), ("highest", torch.float32)):
        cfg = EngineConfig(num_blocks=64, dtype="bfloat16", matmul_precision=precision)
        engine = LLMEngine.from_model_dir(str(model_dir), cfg)
        engine.model.fused_layer_ops = fused
        seen.clear()
        engine.add_request("r", prompt, SamplingParams(max_tokens=4, temperature=0.0))
        engine.step()  # the prefill: one SDPA call per layer
        assert len(seen) == engine.model.config.num_hidden_layers
        assert set(seen) == {(dtype, dtype, dtype)}
        while engine.has_unfinished_requests():
            engine.step()
        assert len(seen) == engine.model.config.num_hidden_layers  # decodes: the kernel


@needs_amx
def test_prefix_caching_gives_the_same_bits_under_medium(model_dir: Path) -> None:
    """A row's bits do not depend on its step's rows, so prompts sharing a 48-token prefix get
    the same tokens and log-probabilities, bit for bit, with the prefix recomputed or served
    from the cache."""
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(2, 60, (48,), generator=gen).tolist()
    prompts = [prefix + torch.randint(2, 60, (n,), generator=gen).tolist() for n in (22, 9, 30)]

    def run(caching: bool, passes: int) -> list[list[tuple[int, float]]]:
        cfg = EngineConfig(num_blocks=64, dtype="bfloat16", enable_prefix_caching=caching,
                           matmul_precision="medium")  # fmt: skip
        engine = LLMEngine.from_model_dir(str(model_dir), cfg)
        got, cached = greedy_logprobs(engine, prompts, passes)
        assert (cached >= 3 * 48) is caching
        return got

    assert run(caching=True, passes=2) == run(caching=False, passes=1)


@built
def test_medium_is_refused_on_a_float32_model(model_dir: Path) -> None:
    model = load_model(model_dir)
    with pytest.raises(InvalidRequestError, match="needs bfloat16 weights"):
        model.set_matmul_precision("medium")
    assert model.matmul_precision == "highest"
