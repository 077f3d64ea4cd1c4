"""bench_engine's ``prefill`` fixture: uncached prefill against torch.mm's FLOP rate, same run.

What is timed: one request of ``n`` random tokens, ``max_tokens=1``, prefix caching off, one
engine step (``max_num_batched_tokens`` covers the prompt, so the prefill is not chunked):
the TTFT of an uncached prompt, sampling and scheduling included. transformers runs the same
ids through ``model(ids, logits_to_keep=1)`` (its KV cache built, the vocabulary projection
on the last position only, as pagedkv's runner does), rounds interleaved.

FLOPs counted (:func:`prefill_flops`), per prompt of ``n`` tokens on a model with ``L`` layers,
``H`` query heads of ``d`` dims, ``K`` KV heads, hidden ``h``, intermediate ``I``, vocab ``V``:

* linear: ``2 * n * in * out`` summed over q/k/v, o, gate/up, down in every layer, that is
  ``2 * n * L * (h*(H+2K)*d + H*d*h + 2*h*I + I*h)``, plus ``2 * h * V`` (one row's logits);
* attention, causal: query ``i`` (0-based) reads ``c_i = min(i + 1, window)`` keys, and each
  (query head, key) pair costs ``2*d`` for ``q.k`` and ``2*d`` for ``p.v``:
  ``4 * d * H * L * sum_i c_i`` (``= 2 * d * H * L * n * (n + 1)`` without a window). The
  masked upper triangle is not counted: work spent there is waste, not throughput.

The limit (:func:`mm_limit`): ``torch.mm`` at the model's own linear shapes (``n`` rows
by each distinct ``[in, out]``), measured in the same process right before the cases, as the
FLOP-weighted rate (total FLOPs / total median time). float32: ``x @ W`` with ``W [in, out]``
(the layout pagedkv's projections use). bfloat16: torch's bf16 GEMM in its fastest layout on
this CPU, ``x @ W.T`` (``F.linear``; ``x @ W`` measured ~8x slower still), both operands bf16.
A ``--dtype bfloat16`` engine stores bf16 weights and computes in float32 (``engine/dtype.py``),
so its row is given against both limits; so is the ``bf16 medium`` row (bf16 arithmetic on
AMX, ``engine/bf16_dot.py``), run where the CPU has AMX.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from _harness import Case, Result
from pagedkv.engine import bf16_dot
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.model_config import ModelConfig
from pagedkv.engine.sampler import SamplingParams


@dataclass(frozen=True, slots=True)
class PrefillFlops:
    """FLOPs of one uncached prefill (the module docstring's formulas)."""

    linear: int  # every decoder linear at n rows, plus the vocabulary projection of one row
    attention: int  # causal: the lower triangle (a window's band) only

    @property
    def total(self) -> int:
        return self.linear + self.attention


def linear_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """``[in, out]`` of one layer's linears as pagedkv joins them: q/k/v, o, gate/up, down."""
    h, d = cfg.hidden_size, cfg.head_dim
    nh, nkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    return [(h, (nh + 2 * nkv) * d), (nh * d, h), (h, 2 * inter), (inter, h)]


def prefill_flops(cfg: ModelConfig, n: int) -> PrefillFlops:
    per_row = sum(2 * i * o for i, o in linear_shapes(cfg))
    linear = n * per_row * cfg.num_hidden_layers + 2 * cfg.hidden_size * cfg.vocab_size
    pairs = 0  # (query, key) pairs summed over layers, each layer's window applied
    for layer in range(cfg.num_hidden_layers):
        window = cfg.layer_window(layer)
        if window is None:
            pairs += n * (n + 1) // 2
        else:
            pairs += sum(min(i + 1, window) for i in range(n))
    attention = 4 * cfg.head_dim * cfg.num_attention_heads * pairs
    return PrefillFlops(linear, attention)


Clock = Callable[[], float]
Seen = list[tuple[int, int]]
CLOCKS: dict[str, Clock] = {"wall": time.perf_counter, "cpu": time.thread_time}


def _median_s(fn: Callable[[], object], reps: int, clock: Clock) -> float:
    """Median seconds of ``reps`` calls after one untimed call."""
    fn()
    times = []
    for _ in range(reps):
        t = clock()
        fn()
        times.append(clock() - t)
    return statistics.median(times)


def mm_limit(cfg: ModelConfig, rows: int, dtype: torch.dtype, reps: int, clock: Clock) -> float:
    """torch.mm's FLOP-weighted rate (GFLOP/s) over ``cfg``'s linear shapes at ``rows`` rows
    (the module docstring: the layout per dtype)."""
    gen = torch.Generator().manual_seed(0)
    flops = 0
    seconds = 0.0
    for i, o in linear_shapes(cfg):
        x = torch.randn(rows, i, generator=gen).to(dtype)
        if dtype is torch.float32:
            w = torch.randn(i, o, generator=gen)
            seconds += _median_s(partial(torch.mm, x, w), reps, clock)
        else:
            w = torch.randn(o, i, generator=gen).to(dtype)
            seconds += _median_s(partial(F.linear, x, w), reps, clock)
        flops += 2 * rows * i * o
    return flops / seconds / 1e9


def sdpa_line(cfg: ModelConfig, n: int, reps: int, clock: Clock) -> str:
    """Whether torch's SDPA skips the masked upper triangle: one layer's causal attention
    (``is_causal=True``, as pagedkv and transformers call it for a fresh prompt) against the
    full square (no mask) at the model's heads, ``n`` queries; medians of interleaved runs,
    and the causal call's rate over the triangle's FLOPs (one layer of :func:`prefill_flops`)."""
    gen = torch.Generator().manual_seed(3)
    nh, nkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = torch.randn(1, nh, n, d, generator=gen)
    k, v = torch.randn(2, 1, nkv, n, d, generator=gen)

    def attend(causal: bool) -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=nh != nkv)

    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(reps):
        for causal in (True, False):
            times[causal].append(_median_s(partial(attend, causal), 1, clock))
    causal_s, full_s = (statistics.median(times[c]) for c in (True, False))
    flops = 2 * d * nh * n * (n + 1)
    return (
        f"prefill {n}: one layer's SDPA, causal {causal_s * 1e3:.1f} ms vs full square "
        f"{full_s * 1e3:.1f} ms (ratio {causal_s / full_s:.2f}; 0.5 = only the triangle, 1 = "
        f"the square); causal {flops / causal_s / 1e9:.1f} GFLOP/s over the triangle's FLOPs"
    )


def prefill_cases(
    model_dir: Path, hf: Any, lengths: tuple[int, ...], quick: bool
) -> tuple[list[Case], ModelConfig]:
    """Per prompt length: pagedkv float32, pagedkv bfloat16 (bf16 weights, float32 compute),
    where AMX runs pagedkv bf16 medium (bf16 arithmetic: ``matmul_precision="medium"``), and
    transformers (its own dtype), rounds interleaved. A case's check raises unless every
    timed prefill was uncached and one step."""
    engines = {}
    rows = [("pagedkv", "float32", "highest"), ("pagedkv bfloat16", "bfloat16", "highest")]
    if bf16_dot.amx():  # bf16 arithmetic on AMX (matmul_precision="medium")
        rows.append(("pagedkv bf16 medium", "bfloat16", "medium"))
    for name, dtype, precision in rows:
        cfg = EngineConfig(
            block_size=16, num_blocks=2 * max(lengths) // 16 + 8, max_model_len=4096,
            max_num_batched_tokens=max(2048, max(lengths)), enable_prefix_caching=False,
            dtype=dtype, matmul_precision=precision,
        )  # fmt: skip
        engines[name] = LLMEngine.from_model_dir(str(model_dir), cfg)
    model_cfg = engines["pagedkv"].model.config
    gen = torch.Generator().manual_seed(2)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    cases: list[Case] = []
    for n in lengths:
        prompt = torch.randint(2, model_cfg.vocab_size, (n,), generator=gen).tolist()
        ids = torch.tensor([prompt])
        seen: Seen = []  # (steps, cached tokens) of each pagedkv prefill

        def ours(engine: LLMEngine, prompt: list[int] = prompt, seen: Seen = seen) -> None:
            engine.add_request("p", prompt, one)
            steps = 0
            while engine.has_unfinished_requests():
                steps += 1
                seen.extend((steps, o.num_cached_tokens) for o in engine.step() if o.finished)

        def theirs(ids: torch.Tensor = ids) -> None:
            with torch.inference_mode():
                hf(input_ids=ids, logits_to_keep=1)

        def check(seen: Seen = seen, n: int = n) -> None:
            if set(seen) != {(1, 0)}:
                raise RuntimeError(f"prefill {n}: expected one uncached step each, saw {seen}")

        case = f"prompt={n} uncached"
        common: dict[str, Any] = {"rounds": 2 if quick else 3, "warmup": 1,
                                  "interleave": f"prefill{n}"}  # fmt: skip
        for name, engine in engines.items():
            run = partial(ours, engine)
            cases.append(Case("prefill", case, name, "prompt", run, check=check, **common))
        cases.append(Case("prefill", case, "transformers", "prompt", theirs, **common))
    return cases, model_cfg


def prefill_footer(
    results: list[Result], cfg: ModelConfig, limits: dict[int, dict[str, float]]
) -> list[str]:
    """One line per prefill row: ms, achieved GFLOP/s and its share of each limit."""
    lines = []
    for r in results:
        if r.bench != "prefill":
            continue
        n = int(r.case.split()[0].removeprefix("prompt="))
        flops = prefill_flops(cfg, n)
        gflops = flops.total / r.timing.median_s / 1e9
        fp32, bf16 = limits[n]["float32"], limits[n]["bfloat16"]
        share = f"{100 * gflops / fp32:.0f}% of the float32 limit {fp32:.1f}"
        if r.impl.startswith("pagedkv bf"):
            share += f"; {100 * gflops / bf16:.0f}% of the bf16 limit {bf16:.2f}"
        lines.append(
            f"prefill {n}: {r.impl} {r.timing.median_s * 1e3:.0f} ms, {gflops:.1f} GFLOP/s "
            f"({flops.linear / 1e9:.1f} linear + {flops.attention / 1e9:.1f} attention GFLOP) "
            f"= {share}"
        )
    return lines


def run_prefill(
    model_dir: Path, hf: Any, quick: bool, clock: str
) -> tuple[list[Result], list[str]]:
    """The fixture's results and footer: the limits are measured right before and right after
    the cases (the higher reading is used: a limit is the rate the machine showed it can do),
    at each prompt length's row count, on the cases' ``clock`` (``cpu``, the thread's CPU
    time, leaves out the time a shared machine deschedules a 1-thread run; with more threads
    it would miss the other threads' work, so use ``wall`` there)."""
    from _harness import run_cases

    tick = CLOCKS[clock]

    lengths = (256,) if quick else (1024, 256)
    cases, cfg = prefill_cases(model_dir, hf, lengths, quick)

    def limits() -> dict[int, dict[str, float]]:
        dtypes = {"float32": (torch.float32, 3), "bfloat16": (torch.bfloat16, 1)}
        return {
            n: {name: mm_limit(cfg, n, dt, reps, tick) for name, (dt, reps) in dtypes.items()}
            for n in lengths
        }

    before = limits()
    results = run_cases(cases)
    after = limits()
    sdpa = [sdpa_line(cfg, n, 3, tick) for n in lengths]
    best = {n: {k: max(before[n][k], after[n][k]) for k in before[n]} for n in lengths}
    footer = [
        f"prefill {n}: torch.mm limit at {n} rows before/after the cases: float32 "
        f"{before[n]['float32']:.1f}/{after[n]['float32']:.1f}, bf16 "
        f"{before[n]['bfloat16']:.2f}/{after[n]['bfloat16']:.2f} GFLOP/s"
        for n in lengths
    ]
    return results, footer + sdpa + prefill_footer(results, cfg, best)
