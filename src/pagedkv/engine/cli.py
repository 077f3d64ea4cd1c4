"""``pagedkv demo`` and ``pagedkv generate``."""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.engine.llm import LLM

from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.model_args import (
    add_model_arguments,
    apply_threads,
    engine_config,
    fail,
    model_path,
    setup_logging,
)
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.startup import startup_line
from pagedkv.errors import InvalidRequestError, PagedKVError
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


def _run_workload(
    model_dir: Path,
    *,
    caching: bool,
    turns: int,
    max_tokens: int,
    block_size: int,
    tiers: TierConfig | None = None,
) -> tuple[list[list[int]], list[float], float, float, int]:
    """Multi-turn chats sharing one system prompt; each turn resends the whole conversation.
    Returns outputs, TTFTs, tokens/s, prefix hit rate and generated tokens."""
    engine = LLMEngine.from_model_dir(
        str(model_dir),
        EngineConfig(
            block_size=block_size, num_blocks=2048, enable_prefix_caching=caching, tiers=tiers
        ),
    )
    try:
        return _chat_turns(engine, turns=turns, max_tokens=max_tokens)
    finally:
        engine.close()


def _chat_turns(
    engine: LLMEngine, *, turns: int, max_tokens: int
) -> tuple[list[list[int]], list[float], float, float, int]:
    tok = engine.tokenizer
    assert tok is not None  # the demo model has one
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    convs: list[list[dict[str, str]]] = [
        [{"role": "system", "content": SYSTEM_PROMPT}] for _ in QUESTIONS
    ]
    outputs: list[list[int]] = []
    ttfts: list[float] = []
    generated = 0
    t0 = time.perf_counter()
    for turn in range(turns):
        for i, conv in enumerate(convs):
            conv.append({"role": "user", "content": f"(turn {turn}) {QUESTIONS[i]}"})
            prompt = tok.encode(tok.apply_chat_template(conv), add_special_tokens=False)
            engine.add_request(f"c{i}-t{turn}", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    i = int(out.request_id[1 : out.request_id.index("-")])
                    comp = out.outputs[0]
                    outputs.append(list(comp.token_ids))
                    generated += len(comp.token_ids)
                    if out.ttft_s is not None:
                        ttfts.append(out.ttft_s)
                    convs[i].append({"role": "assistant", "content": comp.text})
    elapsed = time.perf_counter() - t0
    hit_rate = engine.scheduler.stats().prefix_hit_rate
    return outputs, ttfts, generated / elapsed, hit_rate, generated


def demo_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedkv demo",
        description="Build a tiny random-weight Llama locally and run a shared-prefix chat "
        "workload through the engine with prefix caching on and off.",
    )
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--keep", type=Path, default=None, help="write the tiny model here")
    add_tier_arguments(parser)
    args = parser.parse_args(list(argv))
    try:
        tiers = tier_config_from_args(args)  # used by the prefix-caching run
    except PagedKVError as exc:
        parser.error(str(exc))
    from rich.console import Console
    from rich.table import Table

    from pagedkv.engine.tiny import write_tiny_model

    console = Console()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_tiny_model(args.keep or Path(tmp) / "tiny-llama")
        console.print(f"[bold]tiny random-weight Llama[/] written to {model_dir} (no download)")
        table = Table(title=f"{len(QUESTIONS)} chats x {args.turns} turns, shared system prompt")
        for col in ("prefix caching", "TTFT median (ms)", "tokens/s", "hit rate", "tokens"):
            table.add_column(col, justify="right")
        results = {}
        for caching in (False, True):
            res = _run_workload(
                model_dir,
                caching=caching,
                turns=args.turns,
                max_tokens=args.max_tokens,
                block_size=args.block_size,
                tiers=tiers if caching else None,
            )
            results[caching] = res
            _, ttfts, tps, hit, gen = res
            table.add_row(
                "on" if caching else "off",
                f"{statistics.median(ttfts) * 1e3:.1f}",
                f"{tps:.0f}",
                f"{hit:.0%}",
                str(gen),
            )
        console.print(table)
        same = results[True][0] == results[False][0]
        if same:
            console.print("[green]outputs identical[/] with prefix caching on and off")
        else:
            console.print("[red]outputs differ between prefix caching on and off[/]")
    console.print(
        "Point it at a real local model (a Llama/Qwen2/Qwen3 Hugging Face folder with "
        "config.json, *.safetensors and tokenizer.json):\n"
        "  pagedkv generate --model /path/to/model --prompt 'Hello' --max-tokens 64"
    )
    return 0 if same else 1


def generate_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="pagedkv generate", description="Generate text from a local model folder."
    )
    add_model_arguments(parser)
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the template")
    parser.add_argument(
        "--max-tokens", type=int, default=None, help="default: the model's max_new_tokens, or 64"
    )
    parser.add_argument(
        "--temperature", type=float, default=None, help="default: the model's, or 0 (greedy)"
    )
    parser.add_argument("--top-p", type=float, default=None, help="default: the model's")
    parser.add_argument("--top-k", type=int, default=None, help="default: the model's")
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("-v", "--verbose", action="store_true")
    add_tier_arguments(parser)
    args = parser.parse_args(list(argv))
    model = model_path(parser, args)
    config = engine_config(parser, args)
    request = {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "n": args.n,
        "stop": tuple(args.stop),
    }
    try:  # bad values are usage errors, found before the model loads
        SamplingParams(**{k: v for k, v in request.items() if v is not None})
    except PagedKVError as exc:
        parser.error(str(exc))
    setup_logging(logging.INFO if args.verbose else logging.WARNING)
    apply_threads(args)
    from pagedkv.engine.llm import LLM

    try:
        llm = LLM(model, config)
        sys.stderr.write(startup_line(llm.engine, model) + "\n")
        # the command's own fallbacks, below the checkpoint's defaults: greedy, 64 tokens
        defaults = llm.engine.generation_defaults
        if request["max_tokens"] is None:
            request["max_tokens"] = defaults.max_tokens or 64
        if request["temperature"] is None and defaults.temperature is None:
            request["temperature"] = 0.0
        params = llm.engine.default_sampling_params(**request)
        with llm:  # close(): queued blocks reach the KV tiers before exit
            prompts = _chat_prompts(llm, args.prompt) if args.chat else list(args.prompt)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - t0
    except PagedKVError as exc:
        return fail("generate", exc)
    from rich.console import Console

    console = Console()
    total = 0
    for prompt, out in zip(args.prompt, outs, strict=True):
        console.rule(prompt[:60])
        for comp in out.outputs:
            total += len(comp.token_ids)
            console.print(f"[{comp.index}] {comp.text}  [dim]({comp.finish_reason})[/]")
    sys.stderr.write(f"{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)\n")
    return 0


def _chat_prompts(llm: LLM, prompts: Sequence[str]) -> list[list[int]]:
    """Each prompt as one user turn through the chat template, as token ids (the template
    writes the special tokens, BOS included: encoded without adding more)."""
    tok = llm.engine.tokenizer
    if tok is None:
        raise InvalidRequestError("--chat needs a tokenizer (tokenizer.json, or --tokenizer DIR)")
    return [
        tok.encode(
            tok.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False
        )
        for p in prompts
    ]
