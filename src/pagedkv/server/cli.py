"""``pagedkv serve``: the OpenAI-compatible server for a local model folder."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from pagedkv.config import env_str
from pagedkv.engine.native import add_decode_kernel_argument
from pagedkv.errors import PagedKVError
from pagedkv.tiers.config import add_tier_arguments, tier_config_from_args


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedkv serve",
        description="Serve a local Hugging Face model folder over an "
        "OpenAI-compatible HTTP API (completions, chat, models, health, metrics).",
    )
    p.add_argument("--model", required=True, help="local model folder (config.json, *.safetensors)")
    p.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: folder name)"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this Bearer token (or PAGEDKV_API_KEY)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-pending", type=int, default=256, help="requests in flight before 429")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--num-speculative-tokens", type=int, default=0)
    add_decode_kernel_argument(p)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's choice; 1 is often faster on a busy CPU)",
    )
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let chat requests use tool_choice "auto" (needs --tool-call-parser)',
    )
    p.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=None,
        help="how tool calls are read from the model's text (vLLM's parser names)",
    )
    add_tier_arguments(p)
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise SystemExit("pagedkv serve: --enable-auto-tool-choice needs --tool-call-parser")
    import uvicorn

    from pagedkv.engine.engine_config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.server.app import build_app
    from pagedkv.server.async_engine import AsyncEngine

    logging.basicConfig(level=args.log_level.upper())
    if args.threads is not None:
        if args.threads < 1:
            raise SystemExit(f"pagedkv serve: --threads must be >= 1, got {args.threads}")
        import torch

        torch.set_num_threads(args.threads)
    try:
        tiers = tier_config_from_args(args)
    except PagedKVError as exc:
        raise SystemExit(f"pagedkv serve: {exc}") from None
    cfg = EngineConfig(
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=not args.no_prefix_caching,
        num_speculative_tokens=args.num_speculative_tokens,
        decode_kernel=args.decode_kernel,
        tiers=tiers,
    )
    engine = LLMEngine.from_model_dir(args.model, cfg)
    name = args.served_model_name or Path(args.model).resolve().name
    api_key = args.api_key or env_str("PAGEDKV_API_KEY")
    app = build_app(
        AsyncEngine(engine, max_pending=args.max_pending, model_name=name),
        api_key=api_key,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
    )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
