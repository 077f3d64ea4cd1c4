"""``pagedkv demo`` and ``pagedkv generate``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedkv.engine.llm import LLM

from pagedkv.engine.demo import demo_main as demo_main  # re-exported: pagedkv demo
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
from pagedkv.tiers.config import add_tier_arguments


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
