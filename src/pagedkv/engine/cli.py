"""``pagedkv generate`` (and ``pagedkv demo``, which lives in :mod:`pagedkv.engine.demo`)."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Sequence

from pagedkv.engine.demo import demo_main as demo_main  # re-exported: pagedkv demo
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.native import add_decode_kernel_argument
from pagedkv.engine.sampler import SamplingParams
from pagedkv.errors import PagedKVError
from pagedkv.tiers.config import add_tier_arguments, tier_config_from_args


def generate_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagedkv generate", description=__doc__)
    parser.add_argument(
        "--model", required=True, help="a local Hugging Face model folder or a GGUF file"
    )
    parser.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the template")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--stop", action="append", default=[])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--speculative-tokens", type=int, default=0)
    parser.add_argument("--no-prefix-caching", action="store_true")
    add_decode_kernel_argument(parser)
    parser.add_argument("-v", "--verbose", action="store_true")
    add_tier_arguments(parser)
    args = parser.parse_args(list(argv))
    from rich.console import Console
    from rich.logging import RichHandler

    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, handlers=[RichHandler()]
    )
    console = Console()
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            n=args.n,
            stop=tuple(args.stop),
        )
        from pagedkv.engine.llm import LLM

        llm = LLM(
            args.model,
            EngineConfig(
                dtype=args.dtype,
                device=args.device,
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                num_speculative_tokens=args.speculative_tokens,
                enable_prefix_caching=not args.no_prefix_caching,
                decode_kernel=args.decode_kernel,
                tiers=tier_config_from_args(args),
            ),
        )
        prompts: list[str] | list[list[int]] = list(args.prompt)
        if args.chat:
            tok = llm.engine.tokenizer
            if tok is None:
                raise PagedKVError("--chat needs a tokenizer (tokenizer.json, or GGUF metadata)")
            # the template writes the special tokens (BOS included): encode without adding more
            prompts = [
                tok.encode(
                    tok.apply_chat_template([{"role": "user", "content": p}]),
                    add_special_tokens=False,
                )
                for p in args.prompt
            ]
        with llm:  # close(): queued blocks reach the KV tiers before exit
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - t0
    except PagedKVError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    total = 0
    for prompt, out in zip(args.prompt, outs, strict=True):
        console.rule(prompt[:60])
        for comp in out.outputs:
            total += len(comp.token_ids)
            console.print(f"[{comp.index}] {comp.text}  [dim]({comp.finish_reason})[/]")
    console.print(f"[dim]{total} tokens in {elapsed:.2f} s ({total / elapsed:.1f} tokens/s)[/]")
    return 0
