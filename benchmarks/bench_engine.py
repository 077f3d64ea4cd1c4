"""Benchmarks of the reference engine against transformers on the same small model, same run.

Run ``python benchmarks/bench_engine.py`` (a few minutes on 2 cores); ``--quick`` for a smoke
run; ``--json PATH`` writes every row; ``--threads N`` sets torch's threads for both sides
(default 1); ``--decode-kernel torch|native`` forces pagedkv's batched decode attention
(default ``auto``: the native kernel when it builds). Times are wall clock (torch may run its
own threads, so the thread CPU clock could under-count); the rounds of the two
implementations alternate.

Model: a random-weight Llama written locally (hidden 256, 4 layers, 8 query heads over 4 KV
heads, intermediate 704, vocab 320), float32 on CPU; ``--model FILE.gguf`` (or a folder) runs a
real checkpoint instead, e.g. the embedded SmolLM2-135M-Instruct GGUF, dequantized to float32 on
both sides (transformers loads it with its own GGUF loader), with a 1,024-token TTFT prompt of
which 960 tokens are cached. Fixtures:

decode1   one request, a 32-token prompt, 64 greedy tokens; time per generated token.
          transformers: ``generate(max_new_tokens=64, min_new_tokens=64, do_sample=False)``.
decode16  16 concurrent requests, prompts of 16..256 tokens (mixed), 64 tokens each; time per
          generated token. transformers: one left-padded batch through ``generate``.
          Both decode fixtures also give ``decodeN steps`` rows, timed in the same rounds: only
          the steps after every request has its first token (pagedkv: from the end of the
          step at which the last request got it; transformers: from its first logits-processor
          call, which follows the prefill forward), per token generated in those steps. The
          whole-run rows include the prompts' prefill, which the decode limit does not count.
ttft      TTFT of a 2,048-token prompt (max_tokens=1) whose first 1,920 tokens are cached (a
          previous request computed them) vs uncached (prefix cache reset before each round).
prefill   uncached prefill of a 1,024- and a 256-token prompt (``--quick``: 256), max_tokens=1,
          one step: pagedkv float32, pagedkv bfloat16 (bf16 weights, float32 compute) and
          transformers (``model(ids, logits_to_keep=1)``) interleaved; the footer gives ms,
          GFLOP/s (linear 2*rows*in*out + the causal triangle's 4*head_dim per query head and
          key) and the share of torch.mm's float32 and bf16 rates at the model's shapes measured
          in the same run, and whether SDPA skips the masked triangle (``_prefill.py``; Issue
          15). It runs both pagedkv dtypes whatever ``--dtype`` says; transformers runs in
          the reference dtype (keep it float32: its CPU bf16 prefill takes minutes). With
          ``--threads 1`` on a shared machine pass ``--clock cpu``.
overhead  the batch-1 decode step with every linear layer and the vocabulary projection stubbed
          out (each zeroes its output buffer, or returns a cached zero tensor; ``_Stub``): what
          is left is the per-step Python and small-op work (norms, RoPE, K/V write, attention,
          SiLU, scheduling, sampling); ms per step. (Before the fourth round of issue 15 the
          stubs were not ``Projection``s, so the layer ops paid a ``.contiguous()``, a chunk
          and a checked call per stub that the real layers do not pay: those numbers are
          higher.)
grow      growing the KV tensors by 64 blocks when they hold 256 blocks of 1 MiB (256 MiB; a
          16-layer, 8 KV-head, head_dim 64, block 16, float32 layout): reallocation (what
          ``PagedKVCache.grow`` does: new buffers, one copy) vs allocating only a new 64-block
          chunk (what chunked growth would pay, before the cost of gathering across chunks).
The script re-executes itself with glibc's huge-page tunable, as the ``pagedkv`` commands that
run a model do (``pagedkv.engine.host_alloc``; both implementations run in that memory; the
footer says whether it was on; ``PAGEDKV_HUGE_PAGES=0`` keeps 4 KiB pages).
Targets (issue 4): decode1 within 1.2x of transformers; decode16 at least 1.5x faster than its
padded batch; cached TTFT at least 5x faster than uncached. Issue 15: overhead under 3 ms.

decode1, decode16 and overhead also time pagedkv with its native layer ops switched off
(``pagedkv torch-ops``: ``LlamaModel.fused_layer_ops = False``, the same engine, rounds
interleaved), so the ratio column shows what the layer ops buy; and, float32, with
``linear_kernel="native"`` (``pagedkv native-linear``: the batch-invariant few-row kernel of
``pagedkv.engine.fewrow`` for the linears and the head at 2..32 rows). The footer gives each
decode fixture's limit in the same run: batch tokens per step, a step reading every linear
weight and the vocabulary projection once (at the dtype each row's engine stores them in: bf16
counts 2 bytes; the KV cache is not counted) at the bandwidth of a 256 MiB copy, and each
pagedkv row's share of it. For the ``steps`` rows it also gives the limit with the KV read: a
step reads those weights and the K and V of every context position its requests attend to (at
the cache's dtype; the positions are counted as the steps run). At 16 requests that is a
quarter of a bf16 step's bytes, which no kernel can skip. ``--dtype bfloat16`` runs pagedkv
with bf16 weights and float32 compute (``engine/dtype.py``) and adds ``pagedkv float32``, a
float32 engine on the same file, interleaved; ``--reference-dtype float32`` keeps transformers
in float32 (its CPU bf16 is torch's slow bf16 path). Where the CPU has AMX, ``--dtype
bfloat16`` also adds ``pagedkv bf16 medium``: a bf16 engine with ``matmul_precision="medium"``
(bf16 arithmetic on AMX, inputs rounded to bf16: ``engine/bf16_dot.py``), interleaved, with its
own limit (the same bytes).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from _harness import (
    Case,
    Result,
    Timing,
    add_ratios,
    base_parser,
    print_table,
    run_cases,
    selected_fixtures,
    set_clock,
    write_json,
)
from _prefill import run_prefill
from pagedkv.engine import bf16_dot, fewrow
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.host_alloc import HUGE_PAGE_TUNABLE, reexec_with_huge_pages
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.models.projection import Bf16Projection, Projection
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model

FIXTURES = ("decode1", "decode16", "overhead", "ttft", "prefill", "grow")
MODEL = {
    "hidden_size": 256,
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
}


@dataclass(slots=True)
class _DecodeClock:
    """The decode-only part of each call of a decode fixture: (thread CPU ns, wall ns, tokens,
    KV positions) from the moment every request has its first token (its prefill done) to the
    end of the call. ``mark`` is called once per call at that moment with the tokens generated
    so far, ``stop`` at the end with all of them; ``read`` adds the context positions a timed
    step's attention read (pagedkv rows only). The first ``warmup`` calls are dropped."""

    warmup: int
    samples: list[tuple[int, int, int, int]] = field(default_factory=list)
    _t0: tuple[int, int, int] | None = None
    _positions: int = 0

    def mark(self, tokens: int) -> None:
        self._positions = 0
        self._t0 = (time.thread_time_ns(), time.perf_counter_ns(), tokens)

    def read(self, positions: int) -> None:
        self._positions += positions

    def stop(self, tokens: int) -> None:
        w, c = time.perf_counter_ns(), time.thread_time_ns()
        if self._t0 is None:
            raise RuntimeError("decode clock stopped before every request had its first token")
        c0, w0, n0 = self._t0
        self.samples.append((c - c0, w - w0, tokens - n0, self._positions))
        self._t0 = None

    def timing(self) -> Timing:
        """Seconds per decode token, one entry per timed call."""
        kept = self.samples[self.warmup :]
        return Timing(
            tuple(c / 1e9 / n for c, _, n, _ in kept),
            tuple(w / 1e9 / n for _, w, n, _ in kept),
            kept[0][2],
        )

    def positions_per_token(self) -> float:
        """KV context positions the timed steps' attention read, per token they generated."""
        kept = self.samples[self.warmup :]
        return sum(p for *_, p in kept) / sum(n for _, _, n, _ in kept)


def _run(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    clock: _DecodeClock | None = None,
) -> int:
    """Run ``prompts`` to the end; returns the tokens generated. ``clock`` is marked after the
    first step at whose end every request has at least one token; each later step tells it
    the context positions its attention read (the step that makes a request's token ``t``
    reads its prompt and ``t - 1`` generated tokens)."""
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    n = 0
    have: dict[str, int] = {}
    marked = clock is None
    while engine.has_unfinished_requests():
        for out in engine.step():
            rid, now = out.request_id, len(out.outputs[0].token_ids)
            if marked and clock is not None:
                prompt = len(prompts[int(rid[1:])])
                clock.read(sum(prompt + t - 1 for t in range(have.get(rid, 0) + 1, now + 1)))
            have[rid] = now
            if out.finished:
                n += now
        if not marked and len(have) == len(prompts) and min(have.values()) > 0:
            assert clock is not None
            clock.mark(sum(have.values()))
            marked = True
    if clock is not None:
        clock.stop(n)
    return n


class _HFDecodeMark:
    """A transformers logits processor that marks ``clock`` at its first call: that call
    follows the prefill forward, when every row is about to get its first token."""

    def __init__(self, clock: _DecodeClock, rows: int) -> None:
        self.clock, self.rows, self.calls = clock, rows, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.calls == 0:
            self.clock.mark(self.rows)  # the first tokens count as prefill's, as ours do
        self.calls += 1
        return scores


def _hf_generate(
    hf: Any, prompts: list[list[int]], new_tokens: int, clock: _DecodeClock | None = None
) -> int:
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding, as batched generation needs
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    extra: dict[str, Any] = {}
    if clock is not None:
        from transformers import LogitsProcessorList

        extra["logits_processor"] = LogitsProcessorList([_HFDecodeMark(clock, len(prompts))])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            **extra,
        )
    n = int(out.shape[0] * (out.shape[1] - longest))
    if clock is not None:
        clock.stop(n)
    return n


def _step_bytes(engine: LLMEngine) -> tuple[int, int]:
    """(bytes of the weights one decode step reads: every linear and the vocabulary
    projection at their stored dtype, bytes of K and V one context position holds over all
    layers at the cache's dtype): what a step must read besides activations."""
    from bench_qlinear import weight_bytes_per_token

    spec = engine.runner.kv_cache.spec
    return weight_bytes_per_token(engine.model), spec.bytes_per_block // spec.block_size


def decode_cases(
    model_dir: Path, hf: Any, batch: int, quick: bool, kernel: str, dtype: str = "float32"
) -> tuple[list[Case], dict[str, int], dict[str, tuple[int, int]], dict[str, _DecodeClock]]:
    """The fixture's cases, the tokens each generated (filled in as they run), per pagedkv
    row the bytes a decode step reads (``_step_bytes``), and per row its decode-only clock
    (filled in as they run: the steps after every request has its first token)."""
    cfg = EngineConfig(
        block_size=16, num_blocks=512, enable_prefix_caching=False, decode_kernel=kernel,
        dtype=dtype,
    )  # fmt: skip
    engine = LLMEngine.from_model_dir(str(model_dir), cfg)
    step_bytes = dict.fromkeys(("pagedkv", "pagedkv torch-ops"), _step_bytes(engine))
    fused = engine.model.fused_layer_ops
    gen = torch.Generator().manual_seed(0)
    new = 16 if quick else 64
    lengths = [32] if batch == 1 else [16 + (240 * i) // (batch - 1) for i in range(batch)]
    vocab = engine.model.config.vocab_size
    prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    counts: dict[str, int] = {}
    name = f"decode{batch}"
    case = f"batch={batch} prompts={min(lengths)}..{max(lengths)} new={new}"
    total = batch * new
    clocks: dict[str, _DecodeClock] = {}
    warmup = 1  # untimed calls per case; the decode clocks drop the same calls

    def clock(impl: str) -> _DecodeClock:
        return clocks.setdefault(impl, _DecodeClock(warmup=warmup))

    def ours() -> None:
        engine.model.fused_layer_ops = fused
        engine.model.set_linear_kernel("torch")
        counts["pagedkv"] = _run(engine, prompts, params, clock("pagedkv"))

    def torch_ops() -> None:
        engine.model.fused_layer_ops = False
        engine.model.set_linear_kernel("torch")
        counts["pagedkv torch-ops"] = _run(engine, prompts, params, clock("pagedkv torch-ops"))

    def native_linear() -> None:
        engine.model.fused_layer_ops = fused
        engine.model.set_linear_kernel("native")
        counts["pagedkv native-linear"] = _run(
            engine, prompts, params, clock("pagedkv native-linear")
        )

    def theirs() -> None:
        counts["transformers"] = _hf_generate(hf, prompts, new, clock("transformers"))

    fp32 = None
    if dtype != "float32":  # the float32 engine on the same file, interleaved
        fp32 = LLMEngine.from_model_dir(str(model_dir), replace(cfg, dtype="float32"))
        step_bytes["pagedkv float32"] = _step_bytes(fp32)
    medium = None
    if dtype == "bfloat16" and bf16_dot.amx():  # bf16 arithmetic on AMX, interleaved
        medium = LLMEngine.from_model_dir(str(model_dir), replace(cfg, matmul_precision="medium"))
        step_bytes["pagedkv bf16 medium"] = _step_bytes(medium)

    def ours_medium() -> None:
        assert medium is not None
        counts["pagedkv bf16 medium"] = _run(medium, prompts, params, clock("pagedkv bf16 medium"))

    def ours_fp32() -> None:
        assert fp32 is not None
        counts["pagedkv float32"] = _run(fp32, prompts, params, clock("pagedkv float32"))

    rounds = 2 if quick else 5  # interleaved rounds; the median of 5 steadies a noisy host
    common: dict[str, Any] = {"ops": total, "rounds": rounds, "warmup": warmup, "interleave": name}
    cases = [Case(name, case, "pagedkv", "token", ours, **common)]
    if fused:
        cases.append(Case(name, case, "pagedkv torch-ops", "token", torch_ops, **common))
    if dtype == "float32" and fewrow.available():
        cases.append(Case(name, case, "pagedkv native-linear", "token", native_linear, **common))
        step_bytes["pagedkv native-linear"] = step_bytes["pagedkv"]
    if fp32 is not None:
        cases.append(Case(name, case, "pagedkv float32", "token", ours_fp32, **common))
    if medium is not None:
        cases.append(Case(name, case, "pagedkv bf16 medium", "token", ours_medium, **common))
    cases.append(Case(name, case, "transformers", "token", theirs, **common))
    return cases, counts, step_bytes, clocks


def decode_only_results(res: list[Result], clocks: dict[str, _DecodeClock]) -> list[Result]:
    """Rows ``decodeN steps``: each of ``res``'s rows timed over its decode steps only (from
    the end of the step at which every request has its first token to the end), seconds per
    token generated in those steps; the same rounds as the whole-run rows."""
    return [
        Result(f"{r.bench} steps", r.case, r.impl, "token", clocks[r.impl].timing())
        for r in res
        if r.impl in clocks
    ]


@dataclass(frozen=True, slots=True)
class _Stub(Projection):
    """A linear layer that computes nothing. As a ``Projection`` it takes the float path's
    ``into`` like the real layers (the native layer ops then read the step's own buffers, with
    no per-call checks), and only zeroes the output buffer: one small op standing in for
    ``torch.mm``'s dispatch, so the fixture's time is the step minus the matmuls' work.
    Called directly it returns a cached zero tensor per batch size. ``weight_t`` is a
    stride-0 view (``[in, out]``, no memory)."""

    zeros: dict[int, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def like(cls, p: Any) -> _Stub:
        if isinstance(p, Bf16Projection):
            in_f, out_f = p.weight.in_features, p.weight.out_features
        else:
            in_f, out_f = p.weight_t.shape
        return cls(torch.zeros(()).expand(in_f, out_f), None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.zeros.get(x.shape[0])
        if out is None:
            out = self.zeros[x.shape[0]] = torch.zeros(x.shape[0], self.weight_t.shape[1])
        return out

    def into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.zero_()


def stub_linears(engine: LLMEngine) -> None:
    """Replace every linear layer of ``engine``'s model and its vocabulary projection by
    ``_Stub``s (the ``overhead`` fixture's model)."""
    model = engine.model
    for group in (model._qkv, model._o, model._gate_up, model._down):
        group[:] = [_Stub.like(p) for p in group]
    vocab = model.config.vocab_size
    model.logits = lambda hidden: torch.zeros(hidden.shape[0], vocab)  # type: ignore[method-assign]


def overhead_cases(model_dir: Path, quick: bool, kernel: str) -> list[Case]:
    engine = LLMEngine.from_model_dir(
        str(model_dir),
        EngineConfig(block_size=16, num_blocks=512, enable_prefix_caching=False,
                     decode_kernel=kernel),
    )  # fmt: skip
    model = engine.model
    stub_linears(engine)
    rounds, calls = (2, 10) if quick else (7, 30)
    steps = 4 * rounds * calls + 64
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    engine.add_request("o", list(range(2, 34)), params)
    engine.step()  # the prefill
    fused = model.fused_layer_ops

    def step(fused: bool) -> None:
        model.fused_layer_ops = fused
        engine.step()

    case = "batch=1 prompt=32, linears stubbed"
    common: dict[str, Any] = {"calls_per_round": calls, "rounds": rounds, "warmup": 5,
                              "interleave": "overhead"}  # fmt: skip
    cases = [Case("overhead", case, "pagedkv", "step", lambda: step(fused), **common)]
    if fused:
        cases.append(Case("overhead", case, "pagedkv torch-ops", "step", lambda: step(False),
                          **common))  # fmt: skip
    return cases


def ttft_cases(model_dir: Path, quick: bool, real: bool) -> list[Case]:
    gen = torch.Generator().manual_seed(1)
    total, cached = (1024, 960) if real else (512, 480) if quick else (2048, 1920)
    engine = LLMEngine.from_model_dir(
        str(model_dir),
        EngineConfig(block_size=16, num_blocks=2 * total // 16 + 8, max_model_len=4096),
    )
    vocab = engine.model.config.vocab_size
    prompt = torch.randint(2, vocab, (total,), generator=gen).tolist()
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    mgr = engine.scheduler.manager
    hits: list[int] = []

    def warm() -> None:
        mgr.reset_prefix_cache()
        _run(engine, [prompt[: cached + 1]], one)  # commits cached/16 full blocks

    def cold() -> None:
        mgr.reset_prefix_cache()

    def measure() -> None:
        engine.add_request("t", prompt, one)
        while engine.has_unfinished_requests():
            hits.extend(out.num_cached_tokens for out in engine.step() if out.finished)

    def check() -> None:
        if cached not in hits or 0 not in hits:
            raise RuntimeError(f"ttft fixture did not see both a {cached}-token hit and a miss")

    case = f"prompt={total} cached={cached}"
    rounds = 3 if quick else 5
    return [
        Case("ttft", case, "pagedkv cached", "prompt", measure, setup=warm, rounds=rounds,
             warmup=1, interleave="ttft", check=check),
        Case("ttft", case, "pagedkv uncached", "prompt", measure, setup=cold, rounds=rounds,
             warmup=1, interleave="ttft"),
    ]  # fmt: skip


def grow_cases(quick: bool) -> list[Case]:
    from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache

    spec = KVCacheSpec(num_layers=16, block_size=16, num_kv_heads=8, head_dim=64)
    base = 64 if quick else 256
    state: dict[str, PagedKVCache] = {}

    def fresh() -> None:
        state["kv"] = PagedKVCache(spec, base)

    def realloc() -> None:
        state["kv"].grow(base + 64)

    def chunk() -> None:
        shape = (64, spec.block_size, spec.num_kv_heads, spec.head_dim)
        [torch.zeros(shape) for _ in range(2 * spec.num_layers)]

    mib = base * spec.bytes_per_block >> 20
    case = f"{base} blocks ({mib} MiB) + 64"
    return [
        Case("grow", case, "pagedkv realloc", "grow", realloc, setup=fresh, rounds=5, warmup=1,
             interleave="grow"),
        Case("grow", case, "chunk (alt.)", "grow", chunk, rounds=5, warmup=1, interleave="grow"),
    ]  # fmt: skip


def _reference_model(model: Path, dtype: str = "float32") -> Any:
    """transformers' model for a folder or (through its own GGUF loader) a GGUF file."""
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    if model.is_file():
        hf = AutoModelForCausalLM.from_pretrained(
            model.parent, gguf_file=model.name, dtype=torch_dtype
        )
    else:
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype)
    return hf.eval()


def _decode_limit(
    res: list[Result], batch: int, step_bytes: dict[str, tuple[int, int]],
    clocks: dict[str, _DecodeClock],
) -> str:  # fmt: skip
    """The decode limits of the same run, at the bandwidth of a 256 MiB copy (read + write
    bytes, as bench_qlinear's ``copy``) measured now, and each pagedkv row's share of them:
    ``batch`` tokens per step, a step reading every linear weight and the vocabulary
    projection once (``step_bytes[impl][0]``, at the weights' dtype; the KV cache not
    counted); and, for the ``steps`` rows, a step reading those weights and also the K and V
    of every context position its requests attend to (``step_bytes[impl][1]`` per position,
    the positions counted by the row's clock): the bytes no kernel can skip."""
    from bench_qlinear import copy_gbs

    gbs = copy_gbs()
    shares = []
    for r in res:
        if r.impl not in step_bytes:
            continue
        weights, per_position = step_bytes[r.impl]
        tok_s = 1 / r.timing.median_s
        limit = batch * gbs * 1e9 / weights
        line = (
            f"{r.impl}{' steps' if r.bench.endswith(' steps') else ''} {tok_s:.0f} tok/s = "
            f"{100 * tok_s / limit:.0f}% of {limit:.0f} ({weights / 1e6:.0f} MB per step)"
        )
        if r.bench.endswith(" steps"):
            kv = clocks[r.impl].positions_per_token() * per_position  # bytes per token
            with_kv = gbs * 1e9 / (weights / batch + kv)
            line += (
                f", {100 * tok_s / with_kv:.0f}% of {with_kv:.0f} with the KV read "
                f"({kv * batch / 1e6:.0f} MB per step)"
            )
        shares.append(line)
    return f"decode{batch}: limits at {gbs:.1f} GB/s copy: {'; '.join(shares)}"


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "")
    parser.set_defaults(clock="wall")
    parser.add_argument(
        "--decode-kernel",
        default="auto",
        choices=("auto", "torch", "native"),
        help="pagedkv's batched decode attention (EngineConfig.decode_kernel; default auto: "
        "the native kernel when it builds)",
    )
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a GGUF file or model folder to run instead of the random tiny Llama",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for both implementations (default 1: on a shared 2-core machine "
        "more threads spin against other jobs and the numbers swing 5x)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="pagedkv's decode runs (the TTFT rows stay float32); bfloat16 adds a 'pagedkv "
        "float32' row on the same file, interleaved (on a CPU bfloat16 is bf16 weights with "
        "float32 compute: engine/dtype.py)",
    )
    parser.add_argument(
        "--reference-dtype",
        default=None,
        choices=("float32", "bfloat16"),
        help="transformers' dtype (default: --dtype; its CPU bf16 runs torch's bf16 ops, ~6x "
        "slower than float32 on a CPU without bf16 arithmetic)",
    )
    args = parser.parse_args(argv)
    set_clock(args.clock)
    torch.set_num_threads(args.threads)
    only = selected_fixtures(parser, args, FIXTURES)
    results: list[Result] = []
    footer: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or write_tiny_model(Path(tmp) / "bench-llama", **MODEL)
        hf = _reference_model(model_dir, args.reference_dtype or args.dtype)
        for batch in (1, 16):
            if f"decode{batch}" not in only:
                continue
            cases, counts, step_bytes, clocks = decode_cases(
                model_dir, hf, batch, args.quick, args.decode_kernel, args.dtype
            )
            res = run_cases(cases)
            expected = cases[0].ops
            if set(counts.values()) != {expected} or "transformers" not in counts:
                raise RuntimeError(f"decode{batch}: generated {counts}, expected {expected} each")
            steps = decode_only_results(res, clocks)
            results += res + steps
            footer.append(_decode_limit(res + steps, batch, step_bytes, clocks))
        if "overhead" in only:
            results += run_cases(overhead_cases(model_dir, args.quick, args.decode_kernel))
        if "ttft" in only:
            res = run_cases(ttft_cases(model_dir, args.quick, args.model is not None))
            speedup = res[1].timing.median_s / res[0].timing.median_s
            footer.append(f"ttft: cached is {speedup:.1f}x faster than uncached (target >= 5x)")
            results += res
        if "prefill" in only:  # benchmarks/_prefill.py
            res, lines = run_prefill(model_dir, hf, args.quick, args.clock)
            results += res
            footer += lines
    if "grow" in only:
        results += run_cases(grow_cases(args.quick))
    add_ratios(results)
    footer += [
        f"overhead: {r.impl} {r.timing.median_s * 1e3:.2f} ms per step (target < 3 ms)"
        for r in results
        if r.bench == "overhead"
    ]
    for r in results:
        if r.impl == "transformers" and r.ratio is not None and r.bench.startswith("decode"):
            target = {"decode1": "1/1.2", "decode16": "1.5"}[r.bench.split()[0]]
            if r.bench == "decode16 steps":
                target = "2 (issue 15)"
            footer.append(
                f"{r.bench}: transformers time / pagedkv time = {r.ratio:.2f} "
                f"(target >= {target}); "
                f"pagedkv {1 / next(x for x in results if x.bench == r.bench).timing.median_s:.0f}"
                f" tokens/s, transformers {1 / r.timing.median_s:.0f} tokens/s"
            )
    huge = HUGE_PAGE_TUNABLE in os.environ.get("GLIBC_TUNABLES", "")
    footer.append(
        f"huge pages: {'on' if huge else 'off'} for both implementations (the script re-executes "
        "itself with GLIBC_TUNABLES=glibc.malloc.hugetlb=1, as the pagedkv model commands do; "
        "PAGEDKV_HUGE_PAGES=0: off)"
    )
    print_table("pagedkv engine vs transformers (wall clock)", results, footer)
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    reexec_with_huge_pages()  # the memory the pagedkv commands run in (host_alloc)
    sys.exit(main())
