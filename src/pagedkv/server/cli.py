"""``pagedkv serve``: the OpenAI-compatible server for a local model folder.

The listening socket is bound before the model loads, so a port in use fails at once (exit 1)
instead of after a long load; uvicorn then serves on that socket.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from pagedkv.config import env_str
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.model_args import (
    add_model_arguments,
    apply_threads,
    engine_config,
    fail,
    model_path,
    setup_logging,
)
from pagedkv.errors import PagedKVError

_LOG_LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedkv serve",
        description="Serve a local Hugging Face model folder over an "
        "OpenAI-compatible HTTP API (completions, chat, models, health, metrics).",
    )
    add_model_arguments(p)
    p.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: folder name)"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require this Bearer token (or PAGEDKV_API_KEY)")
    p.add_argument("--max-pending", type=int, default=256, help="requests in flight before 429")
    p.add_argument("--log-level", default="info", type=str.lower, choices=_LOG_LEVELS)
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
    sock.set_inheritable(True)
    return sock


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    model = model_path(parser, args)
    cfg = engine_config(parser, args)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    setup_logging("DEBUG" if args.log_level == "trace" else args.log_level)
    apply_threads(args)
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as exc:
        return fail("serve", f"cannot listen on {args.host}:{args.port}: {exc.strerror or exc}")
    try:
        return _serve(args, model, cfg, sock)
    finally:
        sock.close()


def _serve(args: argparse.Namespace, model: str, cfg: EngineConfig, sock: socket.socket) -> int:
    import uvicorn

    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.startup import startup_line
    from pagedkv.server.app import build_app
    from pagedkv.server.async_engine import AsyncEngine

    try:
        engine = LLMEngine.from_model_dir(model, cfg)
    except PagedKVError as exc:
        return fail("serve", exc)
    name = args.served_model_name or Path(model).resolve().name
    sys.stderr.write(startup_line(engine, model) + f" | served as {name!r}\n")
    api_key = args.api_key or env_str("PAGEDKV_API_KEY")
    app = build_app(
        AsyncEngine(engine, max_pending=args.max_pending, model_name=name), api_key=api_key
    )
    config = uvicorn.Config(app, log_level=args.log_level, log_config=None)
    uvicorn.Server(config).run(sockets=[sock])
    return 0
