"""The AMX prompt-attention kernel (``pagedkv.engine.prompt_attention``): within the bf16
roundings of a float64 reference, a row's bits independent of everything but its own query
and the K/V up to its position (chunking, a cached prefix, the thread count, stale pool data),
refusals, and, in a ``medium`` engine, prefix caching and chunked prefill that give the same
bits as one uncached prefill past the length where torch's SDPA changes them."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F  # noqa: N812

from differential.engine_runs import greedy_logprobs, scheduled
from pagedkv.engine import native, prompt_attention
from pagedkv.engine.attention import attend, build_metadata
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.errors import InvalidRequestError

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(
        not (prompt_attention.available() or prompt_attention.available_f32()),
        reason="neither prompt kernel runs here (no AMX-BF16, no AVX-512)",
    ),
]
needs_amx = pytest.mark.skipif(not prompt_attention.available(), reason="no AMX-BF16 kernel")
needs_f32 = pytest.mark.skipif(not prompt_attention.available_f32(), reason="no AVX-512")


class Case:
    """Random bf16 pools with the sequence's blocks scattered among stale ones (NaN-filled:
    a kernel that read past the context would poison its rows), and float32 queries."""

    def __init__(
        self, ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int,
        pool: torch.dtype = torch.bfloat16, f32: bool = False,
    ) -> None:  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        need = -(-ctx // block_size)
        shape = (kv_heads, need + 3, block_size, head_dim)
        self.k = torch.randn(shape, generator=gen).to(pool)
        self.v = torch.randn(shape, generator=gen).to(pool)
        self.kernel = (
            prompt_attention.prompt_attention_f32 if f32 else prompt_attention.prompt_attention
        )
        self.f32 = f32
        self.table = torch.randperm(need + 3, generator=gen)[:need].to(torch.int64)
        stale = torch.ones(need + 3, dtype=torch.bool)
        stale[self.table] = False
        self.stale = int(stale.nonzero()[0])
        self.k[:, stale] = float("nan")
        self.v[:, stale] = float("nan")
        if ctx % block_size:  # the slots past the context in its last block: stale too
            self.k[:, self.table[-1], ctx % block_size :] = float("nan")
            self.v[:, self.table[-1], ctx % block_size :] = float("nan")
        self.q = torch.randn(ctx, heads, head_dim, generator=gen) * 2
        self.ctx, self.heads, self.scale = ctx, heads, head_dim**-0.5

    def run(self, start: int, n: int, threads: int = 1, window: int = 0) -> torch.Tensor:
        """Rows ``start .. start + n - 1``. With a window, the table's entries wholly before
        the chunk's first window point at a NaN-filled stale block, as a window's released
        blocks point at the null block: the kernel must not read them."""
        out = torch.full((n, self.heads, self.q.shape[2]), float("nan"))
        table = self.table
        if window and start + 1 > window:
            table = table.clone()
            table[: (start + 1 - window) // self.k.shape[2]] = self.stale
        return self.kernel(
            self.q[start : start + n], out, self.k, self.v, table, start, self.scale, window,
            threads=threads,
        )  # fmt: skip

    def reference(self, window: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 attention of every row over the pool's values (queries rounded to bf16
        for the bf16 kernel), each row over its last ``window`` positions when given, and the
        magnitude ``P @ |V|`` its error is measured against."""
        kv_heads, _, _, d = self.k.shape
        group = self.heads // kv_heads

        def gather(pool: torch.Tensor) -> torch.Tensor:
            rows = pool[:, self.table].reshape(kv_heads, -1, d)[:, : self.ctx]
            return rows.double().repeat_interleave(group, 0)  # [heads, ctx, d]

        k, v = gather(self.k), gather(self.v)
        q = (self.q if self.f32 else self.q.to(torch.bfloat16)).double().transpose(0, 1)
        s = q @ k.transpose(1, 2) * self.scale
        future = torch.triu(torch.ones(self.ctx, self.ctx, dtype=torch.bool), 1)
        if window:
            future |= torch.tril(torch.ones(self.ctx, self.ctx, dtype=torch.bool), -window)
        p = s.masked_fill(future, float("-inf")).softmax(-1)
        return (p @ v).transpose(0, 1), (p @ v.abs()).transpose(0, 1)


SHAPES = [  # (ctx, heads, kv_heads, head_dim, block_size)
    pytest.param(200, 9, 3, 64, 16, id="smollm2-group3"),
    pytest.param(77, 4, 4, 32, 32, id="mha-d32-block32"),
    pytest.param(130, 8, 2, 128, 16, id="group4-d128"),  # O^T through memory (d > 64)
    pytest.param(5, 2, 1, 64, 16, id="one-partial-tile"),
]


@needs_amx
@pytest.mark.parametrize(("ctx", "heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_rows_are_within_the_bf16_roundings_of_float64(
    ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int
) -> None:
    """Each output within ``2^-8 * (P @ |V|)`` of the float64 result on the same bf16 inputs:
    the probabilities' bf16 rounding (2^-9 relative) plus the float32 sums."""
    case = Case(ctx, heads, kv_heads, head_dim, block_size, seed=ctx + head_dim)
    ref, mag = case.reference()
    got = case.run(0, ctx).double()
    assert bool(got.isfinite().all())
    err = (got - ref).abs()
    assert bool((err <= 2.0**-8 * mag + 1e-6).all()), float((err / mag).max())


@needs_amx
@pytest.mark.parametrize("rise", [3.0, 40.0, 400.0])
def test_scores_that_climb_along_the_positions_stay_within_the_roundings(rise: float) -> None:
    """Keys whose scores climb by ``rise`` (natural units) every 32 positions, well past
    float32's exponent range over the context: the walk's reference max must follow them (a
    probability relative to a stale max overflows past 2^128), and each row must still be
    within the bf16 roundings of float64, and equal alone and in a chunk."""
    case = Case(300, 9, 3, 64, 16, seed=int(rise))
    case.q[..., 0] = 1.0  # every query reads the keys' first dimension with weight 1
    climb = torch.arange(300, dtype=torch.float64) / 32 * rise / case.scale
    first = case.k[:, case.table, :, 0].reshape(3, -1)  # [kv_heads, positions of the blocks]
    first[:, :300] = climb.to(torch.bfloat16)
    case.k[:, case.table, :, 0] = first.reshape(3, len(case.table), 16)
    ref, mag = case.reference()
    got = case.run(0, 300).double()
    assert bool(got.isfinite().all())
    assert bool(((got - ref).abs() <= 2.0**-8 * mag + 1e-6).all())
    assert torch.equal(case.run(150, 150), got[150:].float())


@needs_amx
@pytest.mark.parametrize(("ctx", "heads", "kv_heads", "head_dim", "block_size"), SHAPES)
def test_a_rows_bits_depend_only_on_its_query_and_its_past(
    ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int, threads: int
) -> None:
    """Any chunk (any start: a cached prefix; any length: chunked prefill or another prompt
    length), at any thread count, gives every row the bits of the whole prompt in one call."""
    case = Case(ctx, heads, kv_heads, head_dim, block_size, seed=7 * ctx)
    whole = case.run(0, ctx, threads=1)
    cuts = sorted({0, 1, ctx // 3, ctx // 2 + 1, ctx - 1, ctx} & set(range(ctx + 1)))
    for a, b in itertools.pairwise(cuts):
        assert torch.equal(case.run(a, b - a, threads), whole[a:b]), (a, b)
    assert torch.equal(case.run(0, ctx, threads), whole)
    head = ctx // 2 + 1  # a shorter prompt with the same head: its rows are the same
    assert torch.equal(case.run(0, head, threads), whole[:head])


@pytest.fixture(scope="module")
def never_guessing() -> native.LazyLibrary[bool]:
    """The bf16 kernel built with ``PA_GUESS_KEPT=0``: every step takes its max first
    (``prompt_softmax.h``'s ``softmax2_in``), the arithmetic the guessing walk must keep."""
    flags = tuple(([*c, "-DPA_GUESS_KEPT=0"], ln) for c, ln in prompt_attention._FLAGS)
    return native.LazyLibrary(
        prompt_attention._CSRC / "prompt_attention.c", prompt_attention._bind,
        "bf16 AMX prompt attention kernel, no guessing", "none", flags,
    )  # fmt: skip


@needs_amx
@pytest.mark.parametrize(
    ("rise", "window", "start"), [(0.0, 0, 0), (0.0, 0, 170), (0.0, 50, 0), (3.0, 0, 0),
                                  (40.0, 0, 0), (400.0, 300, 90), (0.0, 0, 299)],
)  # fmt: skip
def test_guessing_that_a_step_keeps_its_max_changes_no_bit(
    never_guessing: native.LazyLibrary[bool], monkeypatch: pytest.MonkeyPatch, rise: float,
    window: int, start: int, threads: int,
) -> None:  # fmt: skip
    """A step whose last step kept the reference max runs its exponentials against it before
    knowing its own max, and redoes the step where the max moves after all. The outputs are
    those of the build that takes every step's max first, bit for bit: random scores (every
    guess holds), scores climbing by ``rise`` per 32 positions (guesses fail: 3 moves the max
    every few steps, 40 and 400 every step), windows, a chunk after a prefix, one row."""
    case = Case(300, 9, 3, 64, 16, seed=11 + int(rise))
    if rise:
        case.q[..., 0] = 1.0
        climb = torch.arange(300, dtype=torch.float64) / 32 * rise / case.scale
        first = case.k[:, case.table, :, 0].reshape(3, -1)
        first[:, :300] = climb.to(torch.bfloat16)
        case.k[:, case.table, :, 0] = first.reshape(3, len(case.table), 16)
    got = case.run(start, 300 - start, threads, window)
    assert never_guessing.load() is not None
    assert never_guessing.bound
    monkeypatch.setattr(prompt_attention, "_native", never_guessing)
    assert torch.equal(case.run(start, 300 - start, threads, window), got)


F32_SHAPES = [  # (ctx, heads, kv_heads, head_dim, block_size, pool dtype)
    pytest.param(200, 9, 3, 64, 16, torch.bfloat16, id="smollm2-bf16-pool"),
    pytest.param(77, 4, 4, 48, 5, torch.float32, id="mha-d48-block5-f32-pool"),
    pytest.param(130, 8, 2, 128, 32, torch.float32, id="group4-d128"),
    pytest.param(3, 2, 1, 16, 16, torch.bfloat16, id="three-rows-d16"),
]


@needs_f32
@pytest.mark.parametrize(("ctx", "heads", "kv_heads", "head_dim", "block_size", "pool"), F32_SHAPES)
def test_the_float32_kernel_is_float32_exact_and_row_invariant(
    ctx: int, heads: int, kv_heads: int, head_dim: int, block_size: int, pool: torch.dtype,
    threads: int,
) -> None:  # fmt: skip
    """The ``highest`` kernel: within ``2^-14 * (P @ |V|)`` of float64 on the same float32
    queries (no bf16 rounding anywhere: the bf16 kernel's 2^-9 would fail it), and every row's
    bits independent of the chunk, its start and the threads, as for the bf16 kernel."""
    case = Case(ctx, heads, kv_heads, head_dim, block_size, seed=ctx, pool=pool, f32=True)
    ref, mag = case.reference()
    whole = case.run(0, ctx, threads=1)
    err = (whole.double() - ref).abs()
    assert bool((err <= 2.0**-14 * mag + 1e-7).all()), float((err / mag).max())
    for a, b in itertools.pairwise(sorted({0, 1, ctx // 2, ctx - 1, ctx})):
        assert torch.equal(case.run(a, b - a, threads), whole[a:b]), (a, b)
    assert torch.equal(case.run(0, ctx, threads), whole)


@pytest.mark.parametrize(
    "f32",
    [
        pytest.param(False, marks=needs_amx, id="amx"),
        pytest.param(True, marks=needs_f32, id="float32"),
    ],
)
@pytest.mark.parametrize(("window", "block_size"), [(50, 16), (16, 32), (1, 16), (300, 16)])
def test_a_sliding_window_is_exact_and_row_invariant(
    f32: bool, window: int, block_size: int, threads: int
) -> None:
    """Each row over its last ``window`` positions: within the kernel's bound of float64, and
    the same bits in any chunk, at any start (the blocks wholly before a chunk's first window
    NaN-filled: a released block is never read) and thread count."""
    case = Case(200, 9, 3, 64, block_size, seed=window, f32=f32)
    ref, mag = case.reference(window)
    whole = case.run(0, 200, window=window)
    bound = 2.0**-14 if f32 else 2.0**-8
    assert bool(((whole.double() - ref).abs() <= bound * mag + 1e-6).all())
    for a, b in itertools.pairwise([0, 1, 60, 133, 199, 200]):
        assert torch.equal(case.run(a, b - a, threads, window), whole[a:b]), (a, b)


@needs_amx
def test_it_agrees_with_torch_bf16_sdpa_within_rounding() -> None:
    """The same arithmetic as the SDPA call it replaces, up to the order of the sums."""
    case = Case(300, 9, 3, 64, 16, seed=3)
    kv_heads, _, _, d = case.k.shape
    k = case.k[:, case.table].reshape(kv_heads, -1, d)[None, :, :300]
    v = case.v[:, case.table].reshape(kv_heads, -1, d)[None, :, :300]
    sdpa = F.scaled_dot_product_attention(
        case.q.transpose(0, 1)[None].to(torch.bfloat16), k, v, is_causal=True,
        scale=case.scale, enable_gqa=True,
    )[0].transpose(0, 1)  # fmt: skip
    _, mag = case.reference()
    err = (case.run(0, 300).double() - sdpa.double()).abs()
    assert bool((err <= 2.0**-7 * mag + 1e-6).all())


@needs_amx
def test_bad_inputs_are_refused_by_name() -> None:
    case = Case(40, 4, 2, 32, 16, seed=1)
    out = torch.empty(40, 4, 32)
    call = prompt_attention.prompt_attention
    bad = case.table.clone()
    bad[1] = case.k.shape[1]
    with pytest.raises(InvalidRequestError, match="block id"):
        call(case.q, out, case.k, case.v, bad, 0, 0.1)
    with pytest.raises(InvalidRequestError, match="unsupported pools"):
        call(case.q, out, case.k.float(), case.v.float(), case.table, 0, 0.1)
    with pytest.raises(InvalidRequestError, match="unsupported pools"):  # table too short
        call(case.q, out, case.k, case.v, case.table[:2], 0, 0.1)
    with pytest.raises(InvalidRequestError, match="q must be float32"):
        call(case.q.double(), out, case.k, case.v, case.table, 0, 0.1)
    with pytest.raises(InvalidRequestError, match="rows into"):
        call(case.q, out[:10], case.k, case.v, case.table, 0, 0.1)
    for kernel in (call, prompt_attention.prompt_attention_f32):
        with pytest.raises(InvalidRequestError, match="q must be 3-D and the pools 4-D"):
            kernel(case.q[0], out[0], case.k, case.v, case.table, 0, 0.1)
        with pytest.raises(InvalidRequestError, match="q must be 3-D and the pools 4-D"):
            kernel(case.q, out, case.k[0], case.v[0], case.table, 0, 0.1)
    with pytest.raises(InvalidRequestError, match="a bad shape or block id"):  # the C checks
        call(case.q, out, case.k, case.v, case.table, 0, 0.1, window=-1)
    assert not prompt_attention.supports(4, 2, 8, 32)  # block size not a multiple of 16
    assert not prompt_attention.supports(4, 2, 16, 48)  # head_dim not a multiple of 32


@needs_amx
def test_attend_uses_it_where_it_applies_and_sdpa_elsewhere(
    sdpa_calls: list[int],
) -> None:
    """A step of two prompt chunks (one after a cached prefix) and a lone decode (on the
    per-sequence path: no batched decode for one row): with row-major ``q`` every row is the
    kernel's, bit for bit, and SDPA is not called; ``q`` whose heads are not contiguous takes
    SDPA instead (no error), within rounding of the kernel."""
    bs, heads, d = 16, 4, 32
    cache = PagedKVCache(KVCacheSpec(1, bs, 2, d, torch.bfloat16), 12)
    gen = torch.Generator().manual_seed(2)
    cache.kv[0].copy_(torch.randn(cache.kv[0].shape, generator=gen))
    tables = [np.array(t, dtype=np.int32) for t in ([3, 7, 1], [2, 9, 4], [5, 6])]
    starts, lengths = (0, 20, 30), (40, 21, 1)
    seqs = [
        scheduled(rid, t, bs, start, [0] * n)
        for rid, t, start, n in zip("abc", tables, starts, lengths, strict=True)
    ]
    meta = build_metadata(seqs, bs, torch.device("cpu"))
    q = torch.randn(62, heads, d, generator=gen)
    got = attend(0, q, cache, meta, d**-0.5, sdpa_dtype=torch.bfloat16)
    for s, table in zip(meta.seqs, tables, strict=True):
        rows = slice(s.token_offset, s.token_offset + s.num_tokens)
        want = torch.empty(s.num_tokens, heads, d)
        prompt_attention.prompt_attention(
            q[rows], want, cache.k[0], cache.v[0], torch.from_numpy(table.astype(np.int64)),
            s.start_position,
            d**-0.5,
        )  # fmt: skip
        assert torch.equal(got[rows], want)
    assert not sdpa_calls
    strided = torch.randn(62, d, heads, generator=gen).transpose(1, 2)
    strided.copy_(q)
    fallback = attend(0, strided, cache, meta, d**-0.5, sdpa_dtype=torch.bfloat16)
    assert len(sdpa_calls) == 3  # one SDPA call per sequence
    assert torch.allclose(fallback, got, atol=2e-2, rtol=0)


@pytest.fixture
def sdpa_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per call of torch's SDPA during the test (it still runs)."""
    calls: list[int] = []
    real = F.scaled_dot_product_attention

    def sdpa(*args: torch.Tensor, **kw: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    return calls


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("prompt_amx") / "m", hidden_size=128, intermediate_size=192,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, eos_token_id=None,
        max_position_embeddings=4096,
    )  # fmt: skip


@pytest.fixture(scope="module")
def window_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Mistral with a 256-position sliding window on every layer."""
    return write_tiny_model(
        tmp_path_factory.mktemp("prompt_window") / "m", hidden_size=128, intermediate_size=192,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, eos_token_id=None,
        max_position_embeddings=4096, sliding_window=256, model_type="mistral",
        architectures=["MistralForCausalLM"],
    )  # fmt: skip


@pytest.mark.parametrize(
    ("precision", "windowed"),
    [("medium", False), ("highest", False), ("medium", True), ("highest", True)],
)
def test_bf16_caching_and_chunking_keep_the_bits_of_long_prompts(
    model_dir: Path, window_model_dir: Path, sdpa_calls: list[int], precision: str, windowed: bool
) -> None:
    """A bf16 engine, ``medium`` (the AMX kernel, AMX linears) or ``highest`` (the float32
    kernel, float32-compute linears; both sets of linears are batch invariant), on a Llama or
    a Mistral with a 256-position window (released blocks and all): prompts sharing a
    900-token prefix (past the ~600 tokens from which torch's SDPA rows change with the
    context length) get the same tokens and log-probabilities, bit for bit, uncached, served
    from the prefix cache, and prefilled in 256-token chunks; no prompt row reaches SDPA.
    (Before the kernels took windows, the windowed medium engine changed a greedy token.)"""
    if not (
        prompt_attention.available() if precision == "medium" else prompt_attention.available_f32()
    ):
        pytest.skip(f"the {precision} prompt kernel does not run here")
    path = window_model_dir if windowed else model_dir
    gen = torch.Generator().manual_seed(5)
    prefix = torch.randint(2, 60, (900,), generator=gen).tolist()
    # tails of 22, 9, 130 and 13 tokens: the last prompt (913 tokens) leaves a one-token chunk
    # after its 912 cached ones
    tails = (22, 9, 130, 13)
    prompts = [prefix + torch.randint(2, 60, (n,), generator=gen).tolist() for n in tails]

    def run(passes: int, **kw: object) -> tuple[list[object], int]:
        cfg = EngineConfig(num_blocks=512, dtype="bfloat16", matmul_precision=precision,
                           max_model_len=4096, **kw)  # type: ignore[arg-type]  # fmt: skip
        engine = LLMEngine.from_model_dir(str(path), cfg)
        return greedy_logprobs(engine, prompts, passes, max_tokens=4)

    uncached, none = run(1, enable_prefix_caching=False)
    cached, hits = run(2, enable_prefix_caching=True)
    chunked, _ = run(1, enable_prefix_caching=False, max_num_batched_tokens=256)
    assert none == 0
    assert hits >= 3 * 896 + 912
    assert cached == uncached
    assert chunked == uncached
    assert not sdpa_calls


@needs_amx
@pytest.mark.parametrize(("head_dim", "block_size"), [(48, 16), (32, 8)])
def test_medium_on_a_shape_the_amx_kernel_refuses_keeps_the_bits_with_the_float32_kernel(
    tmp_path: Path, sdpa_calls: list[int], head_dim: int, block_size: int
) -> None:
    """``medium`` where the AMX kernel does not take the shape (head_dim not a multiple of 32,
    or a block size not a multiple of 16): the float32 kernel serves the prompt rows, not
    torch's bf16 SDPA (whose rows change with the context length: a cached prefix changed
    a log-probability), so prefix caching and chunked prefill keep every bit."""
    path = write_tiny_model(
        tmp_path / "m", hidden_size=4 * head_dim, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, eos_token_id=None,
        max_position_embeddings=2048,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(3)
    prefix = torch.randint(2, 60, (300,), generator=gen).tolist()
    prompts = [prefix + torch.randint(2, 60, (n,), generator=gen).tolist() for n in (1, 7, 33)]

    def run(passes: int, **kw: object) -> tuple[list[object], int]:
        cfg = EngineConfig(num_blocks=512, block_size=block_size, dtype="bfloat16",
                           matmul_precision="medium", max_model_len=2048, max_num_seqs=8,
                           **kw)  # type: ignore[arg-type]  # fmt: skip
        return greedy_logprobs(LLMEngine.from_model_dir(str(path), cfg), prompts, passes)

    uncached, _ = run(1, enable_prefix_caching=False)
    cached, hits = run(2, enable_prefix_caching=True)
    chunked, _ = run(1, enable_prefix_caching=False, max_num_batched_tokens=48)
    assert hits >= 3 * (300 // block_size * block_size)
    assert cached == uncached
    assert chunked == uncached
    assert not sdpa_calls


@pytest.mark.parametrize("precision", ["medium", "highest"])
def test_a_prompts_last_token_alone_in_a_chunk_keeps_the_bits(
    model_dir: Path, sdpa_calls: list[int], precision: str
) -> None:
    """A 65-token prompt at a 64-token budget: its last token is computed alone in the next
    step. It is a prompt row (the scheduler makes it a one-token prefill chunk), so the
    first token's log-probability has the bits of the unchunked prefill; as a decode row
    (the native decode kernel's arithmetic) it differed in the last bits."""
    if not (
        prompt_attention.available() if precision == "medium" else prompt_attention.available_f32()
    ):
        pytest.skip(f"the {precision} prompt kernel does not run here")
    gen = torch.Generator().manual_seed(24)
    prompts = [torch.randint(2, 60, (65,), generator=gen).tolist()]

    def run(**kw: object) -> list[object]:
        cfg = EngineConfig(num_blocks=64, block_size=16, dtype="bfloat16", max_model_len=512,
                           matmul_precision=precision, enable_prefix_caching=False,
                           **kw)  # type: ignore[arg-type]  # fmt: skip
        return greedy_logprobs(LLMEngine.from_model_dir(str(model_dir), cfg), prompts)[0]

    assert run(max_num_batched_tokens=64) == run()
    assert not sdpa_calls


@needs_amx
@pytest.mark.parametrize(("start", "n", "row0"), [(0, 200, 0), (150, 50, 7), (199, 1, 30)])
def test_outputs_written_as_tiles_are_the_float_outputs_rounded(
    start: int, n: int, row0: int
) -> None:
    """``prompt_attention_tiles`` writes rows ``row0 ..`` of the o projection's A tiles with
    the float32 outputs rounded to bf16 (as torch rounds them: nearest even) in the tile
    layout, and leaves every other row of the tiles as it was."""
    case = Case(200, 9, 3, 64, 16, seed=row0 + n)
    want = case.run(start, n).reshape(n, 9 * 64)
    total = row0 + n + 5
    tiles = torch.full((-(-total // 16) * 16 * 576,), float("nan"), dtype=torch.bfloat16)
    prompt_attention.prompt_attention_tiles(
        case.q[start : start + n], tiles, row0, case.k, case.v, case.table, start, case.scale
    )
    rows = tiles.view(-1, 18, 16, 32).permute(0, 2, 1, 3).reshape(-1, 576)  # row-major again
    assert torch.equal(rows[row0 : row0 + n], want.to(torch.bfloat16))
    others = torch.cat((rows[:row0], rows[row0 + n :]))
    assert bool(others.isnan().all())
    with pytest.raises(InvalidRequestError, match="tiles"):
        prompt_attention.prompt_attention_tiles(
            case.q[:n], tiles[: 16 * 576], row0 + 16, case.k, case.v, case.table, 0, case.scale
        )


@needs_amx
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size"),
    [(9, 3, 64, 16), (8, 8, 64, 16), (16, 1, 32, 32), (12, 2, 64, 64)],
)
def test_medium_decode_rows_have_the_prompt_kernels_bits(
    heads: int, kv_heads: int, head_dim: int, block_size: int, threads: int
) -> None:
    """Under ``medium`` the native decode call computes each row with the bf16 prompt
    kernel's arithmetic (``pagedkv_decode_amx``): every row equals ``prompt_attention`` for the
    same query at its position, bit for bit, at any thread count, so the K/V a decode step
    writes are those a prompt computing the same tokens writes. Windowed rows (a start) and
    other precisions keep the float32 decode kernel."""
    from pagedkv.engine import native

    lens = [1, 2, 15, 16, 17, 31, 32, 33, 63, 64, 65, 100, 255, 256, 257, 300]
    gen = torch.Generator().manual_seed(heads + head_dim)
    per = [-(-n // block_size) for n in lens]
    blocks = sum(per) + 5
    k, v = (torch.randn(kv_heads, blocks, block_size, head_dim, generator=gen).bfloat16()
            for _ in range(2))  # fmt: skip
    perm, tables, at = torch.randperm(blocks, generator=gen), torch.zeros(16, max(per) + 1), 0
    tables = tables.to(torch.int64)
    for s, n in enumerate(per):
        tables[s, :n] = perm[at : at + n]
        at += n
    q = torch.randn(16, heads, head_dim, generator=gen) * 2
    lens_t = torch.tensor(lens, dtype=torch.int64)
    prepared = native.PreparedDecode(k, v, tables, lens_t, head_dim**-0.5, heads, threads,
                                     prompt_bits=True)  # fmt: skip
    assert prepared.symbol == "pagedkv_decode_amx"
    out = torch.full_like(q, float("nan"))
    prepared(q, out, k, v)
    for s, n in enumerate(lens):
        want = prompt_attention.prompt_attention(
            q[s : s + 1], torch.empty(1, heads, head_dim), k, v, tables[s].contiguous(), n - 1,
            head_dim**-0.5, threads=1,
        )  # fmt: skip
        assert torch.equal(out[s : s + 1], want), s
    starts = torch.ones(16, dtype=torch.int64)
    windowed = native.PreparedDecode(k, v, tables, lens_t + 1, head_dim**-0.5, heads, threads,
                                     starts=starts, prompt_bits=True)  # fmt: skip
    plain = native.PreparedDecode(k, v, tables, lens_t, head_dim**-0.5, heads, threads)
    assert "amx" not in windowed.symbol
    assert "amx" not in plain.symbol
