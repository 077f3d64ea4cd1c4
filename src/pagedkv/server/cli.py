"""``pagedkv serve``: the OpenAI-compatible server for a local model folder.

The listening socket is bound before the model loads, so a port in use fails at once (exit 1)
instead of after a long load; uvicorn then serves on that socket.
"""

from __future__ import annotations

import argparse
import socket
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pagedkv.config import env_str
from pagedkv.engine.model_args import (
    add_model_arguments,
    apply_threads,
    engine_config,
    fail,
    model_path,
    setup_logging,
)
from pagedkv.errors import PagedKVError
from pagedkv.kvevents.config import KVEventsConfig
from pagedkv.server.limits_cli import add_server_limit_arguments, check_server_limits
from pagedkv.tiers.config import add_tier_arguments

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedkv serve",
        description="Serve a local Hugging Face model folder over an "
        "OpenAI-compatible HTTP API (completions, chat, models, health, metrics).",
    )
    add_model_arguments(p)  # MODEL, --dtype, --max-model-len, --threads, ... (vLLM's names)
    p.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: folder name)"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this Bearer token (or PAGEDKV_API_KEY)")
    p.add_argument("--max-pending", type=int, default=256, help="requests in flight before 429")
    add_server_limit_arguments(p)
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--kv-events",
        metavar="ENDPOINT",
        default=None,
        help="publish KV events over ZeroMQ at this bound endpoint (tcp://HOST:PORT, PORT may "
        "be *), in vLLM's format; GET /kv_events tells where",
    )
    p.add_argument(
        "--kv-events-replay",
        metavar="ENDPOINT",
        default=None,
        help="the replay (ROUTER) endpoint (default: PORT + 1 of --kv-events; '' for none)",
    )
    p.add_argument(
        "--role",
        default="both",
        choices=["both", "prefill", "decode"],
        help="prefill/decode disaggregation through the shared --redis tier (pagedkv router "
        "--prefill URL --engine URL); a prefill engine answers once its KV is stored",
    )
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


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (as uvicorn binds: SO_REUSEADDR); OSError when
    the address is in use or cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def serve_on(app: Any, sock: socket.socket, **uvicorn_options: Any) -> None:
    """Run uvicorn on an already bound socket until it shuts down; closes the socket."""
    import uvicorn

    try:
        uvicorn.Server(uvicorn.Config(app, log_config=None, **uvicorn_options)).run(sockets=[sock])
    finally:
        sock.close()


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    model = model_path(parser, args)
    cfg = engine_config(parser, args)  # usage errors exit 2 here, before anything loads
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    args.log_level = args.log_level.lower()
    if args.log_level not in _LOG_LEVELS:
        parser.error(f"--log-level must be one of {', '.join(_LOG_LEVELS)}, got {args.log_level!r}")
    check_server_limits(parser, args)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser")
    from pagedkv.server.roles import add_prefill_role, check_role

    try:
        kv_events = None
        if args.kv_events is not None:
            kv_events = KVEventsConfig(args.kv_events, replay_endpoint=args.kv_events_replay)
        check_role(args.role, cfg.tiers is not None and cfg.tiers.redis_url is not None)
    except PagedKVError as exc:
        parser.error(str(exc))
    cfg = replace(cfg, kv_events=kv_events)
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.startup import startup_line
    from pagedkv.server.app import build_app
    from pagedkv.server.async_engine import AsyncEngine

    setup_logging("debug" if args.log_level == "trace" else args.log_level)
    apply_threads(args)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        return fail("serve", f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    try:
        engine = LLMEngine.from_model_dir(model, cfg)
    except PagedKVError as exc:
        sock.close()
        return fail("serve", exc)
    name = args.served_model_name or Path(model).resolve().name
    sys.stderr.write(startup_line(engine, model) + f" | served as {name!r}\n")
    api_key = args.api_key or env_str("PAGEDKV_API_KEY")
    async_engine = AsyncEngine(
        engine,
        max_pending=args.max_pending,
        model_name=name,
        stall_timeout_s=args.health_stall_timeout,
    )
    app = build_app(
        async_engine,
        api_key=api_key,
        max_request_bytes=args.max_request_bytes,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
    )
    if args.role == "prefill":
        add_prefill_role(app, async_engine)
    serve_on(
        app,
        sock,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,  # then open streams are cancelled
    )
    return 0
