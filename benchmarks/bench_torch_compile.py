"""Does ``torch.compile`` pay on the CPU decode step? (issue 15: "consider torch.compile on the
CPU where it pays; measure compile time and the step time, and keep an eager fallback").

The real SmolLM2-135M (float32, 1 torch thread), three forwards of one engine, interleaved round
by round in one process:

* ``fused`` — the default: the native layer ops and the native decode attention;
* ``torch`` — the torch-ops path (``fused_layer_ops = False``), the exact reference;
* ``compiled`` — the torch-ops path with each layer's two attention-free pieces (norm + qkv +
  RoPE; o-proj + residual + norm + MLP + residual) run by ``torch.compile``'d functions. The
  weights are arguments, so one compiled graph per piece serves all 30 layers
  (``dynamic=True``: one graph for every row count). Paged attention stays eager between them.

Reported per variant: the median and minimum thread-CPU time of a decode step (prefill steps
are excluded), the compile time (the first run of the compiled variant, prefill and decode
shapes), and whether every variant's greedy tokens equal the torch path's.

    python benchmarks/bench_torch_compile.py --batch 1 16 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

from _smollm2 import smollm2_checkpoint
from pagedkv.engine.attention import paged_attention
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.models import llama
from pagedkv.engine.sampler import SamplingParams

VARIANTS = ("fused", "torch", "compiled")


def _pre(
    h: torch.Tensor, norm: torch.Tensor, qkv_t: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor, eps: float, nh: int, nkv: int, hd: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The torch path's ops before attention (``LlamaModel.forward``), for one layer."""
    x = llama._rms_norm(h, norm, eps)
    qkv = torch.mm(x, qkv_t).view(h.shape[0], nh + 2 * nkv, hd)
    qk = qkv[:, : nh + nkv]
    qk = qk * cos + llama._rotate_half(qk) * sin
    return qk[:, :nh].contiguous(), qk[:, nh:].contiguous(), qkv[:, nh + nkv :].contiguous()


def _post(
    h: torch.Tensor, att: torch.Tensor, o_t: torch.Tensor, norm: torch.Tensor,
    gate_up_t: torch.Tensor, down_t: torch.Tensor, eps: float,
) -> torch.Tensor:  # fmt: skip
    """The torch path's ops after attention, for one layer."""
    h = h + torch.mm(att, o_t)
    x = llama._rms_norm(h, norm, eps)
    gate, up = torch.mm(x, gate_up_t).chunk(2, dim=-1)
    return h + torch.mm(F.silu(gate) * up, down_t)


def compiled_forward() -> Callable[..., torch.Tensor]:
    """``LlamaModel.forward``'s torch path with ``_pre``/``_post`` compiled (to bind to a
    model of float ``Projection`` layers without a qk-norm or sliding window: SmolLM2)."""
    pre = torch.compile(_pre, dynamic=True)
    post = torch.compile(_post, dynamic=True)

    @torch.inference_mode()
    def forward(self: Any, input_ids: torch.Tensor, meta: Any, cache: Any) -> torch.Tensor:
        cfg = self.config
        eps, n = cfg.rms_norm_eps, input_ids.shape[0]
        nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        cos, sin = self._rope(meta)
        h = F.embedding(input_ids, self.embed)
        for i in range(cfg.num_hidden_layers):
            q, k, v = pre(h, self._in_norm[i], self._qkv[i].weight_t, cos, sin, eps, nh, nkv, hd)
            view = meta.for_window(cfg.layer_window(i))
            att = paged_attention(i, q, k, v, cache, view, self.scale).reshape(n, nh * hd)
            h = post(h, att, self._o[i].weight_t, self._post_norm[i],
                     self._gate_up[i].weight_t, self._down[i].weight_t, eps)  # fmt: skip
        return llama._rms_norm(h, self.final_norm, eps)

    return forward


class Bench:
    """One engine, its three forwards, and the fixture's prompts."""

    def __init__(self, model_dir: Path, batch: int, new_tokens: int) -> None:
        self.engine = LLMEngine.from_model_dir(
            str(model_dir),
            EngineConfig(block_size=16, num_blocks=1024, enable_prefix_caching=False),
        )
        model = self.engine.model
        self.eager = model.forward
        self.compiled = types.MethodType(compiled_forward(), model)
        gen = torch.Generator().manual_seed(0)
        lengths = [32] if batch == 1 else [16 + (240 * i) // (batch - 1) for i in range(batch)]
        vocab = model.config.vocab_size
        self.prompts = [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in lengths]
        self.params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        self.runs = 0

    def use(self, variant: str) -> None:
        model = self.engine.model
        model.fused_layer_ops = variant == "fused"
        model.forward = self.compiled if variant == "compiled" else self.eager  # type: ignore[method-assign]

    def run(self) -> tuple[list[float], list[list[int]]]:
        """Thread-CPU seconds of each decode step, and each request's tokens."""
        self.runs += 1
        ids = [f"r{self.runs}-{i}" for i in range(len(self.prompts))]
        for rid, p in zip(ids, self.prompts, strict=True):
            self.engine.add_request(rid, p, self.params)
        tokens: dict[str, list[int]] = {}
        steps: list[float] = []
        while self.engine.has_unfinished_requests():
            t = time.thread_time()
            outs = self.engine.step()
            steps.append(time.thread_time() - t)
            for out in outs:
                if out.finished:
                    tokens[out.request_id] = list(out.outputs[0].token_ids)
        return steps[1:], [tokens[r] for r in ids]  # step 0 prefills every prompt


def measure(bench: Bench, rounds: int) -> None:
    t = time.perf_counter()
    bench.use("compiled")
    bench.run()
    compile_s = time.perf_counter() - t
    per_step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(rounds):
        for variant in VARIANTS:
            bench.use(variant)
            steps, tokens[variant] = bench.run()
            per_step[variant].append(statistics.median(steps) * 1e3)
    batch = len(bench.prompts)
    print(f"\nbatch {batch}: compile (first compiled run) {compile_s:.1f} s wall")
    print("| variant | decode step median ms | min ms | vs torch (median) | tokens == torch |")
    print("|---|---|---|---|---|")
    base = statistics.median(per_step["torch"])
    for variant in VARIANTS:
        med = statistics.median(per_step[variant])
        same = tokens[variant] == tokens["torch"]
        best = min(per_step[variant])
        print(f"| {variant} | {med:.2f} | {best:.2f} | {base / med:.2f}x | {same} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pagedkv-smollm2-f32"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model_dir = smollm2_checkpoint(args.model_dir)
    for batch in args.batch:
        measure(Bench(model_dir, batch, args.new_tokens), args.rounds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
