"""``pagedkv serve`` flags for the server's limits: request size, health, shutdown."""

from __future__ import annotations

import argparse

from pagedkv.server.middleware import DEFAULT_MAX_REQUEST_BYTES


def add_server_limit_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help=f"largest request body accepted; larger ones get 413 (default "
        f"{DEFAULT_MAX_REQUEST_BYTES})",
    )
    p.add_argument(
        "--health-stall-timeout",
        type=float,
        default=60.0,
        help="/health answers 503 when requests are pending and no engine step finished for "
        "this many seconds (default 60)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, let open streams finish for at most this many seconds, then "
        "abort them (default 30)",
    )


def check_server_limits(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Exit 2 (a usage error, as every command does) naming the flag when a limit is out of
    range."""
    if args.max_request_bytes < 1:
        parser.error(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if not args.health_stall_timeout > 0:
        parser.error(f"--health-stall-timeout must be > 0, got {args.health_stall_timeout}")
    if not args.shutdown_timeout >= 0:
        parser.error(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
