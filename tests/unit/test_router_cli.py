"""Flags of ``pagedkv router`` and ``pagedkv serve --role/--kv-events`` that are refused."""

from __future__ import annotations

import subprocess
import sys

CLI = [sys.executable, "-c", "import sys; from pagedkv.cli import main; sys.exit(main())"]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=120, check=False)


def test_router_needs_an_engine_and_a_known_policy() -> None:
    done = _run("router")
    assert done.returncode == 2
    assert "--engine" in done.stderr
    done = _run("router", "--engine", "http://127.0.0.1:1", "--policy", "random")
    assert done.returncode == 2
    assert "invalid choice" in done.stderr
    done = _run("router", "--engine", "http://127.0.0.1:1", "--cache-threshold", "2")
    assert done.returncode != 0
    assert "cache_threshold must be in [0, 1]" in done.stderr


def test_serve_refuses_a_split_role_without_redis_and_a_bad_events_endpoint() -> None:
    done = _run("serve", "--model", "/nonexistent", "--role", "prefill")
    assert done.returncode != 0
    assert "--role prefill moves KV through the shared tier; add --redis URL" in done.stderr
    done = _run("serve", "--model", "/nonexistent", "--kv-events", "127.0.0.1:5557")
    assert done.returncode != 0
    assert "--kv-events wants tcp://HOST:PORT" in done.stderr
