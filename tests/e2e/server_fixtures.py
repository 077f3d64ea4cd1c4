"""A real pagedkv HTTP server on a free loopback port, for the server end-to-end tests.

``running_server`` builds the engine, the :class:`AsyncEngine` and the FastAPI app, and runs
``uvicorn.Server`` in a thread of the test process, so a test talks to it over real HTTP (the
official ``openai`` client, ``httpx``) and can still reach the engine to check that no block
leaked. ``wait_until`` polls a condition with a deadline: the engine thread frees an aborted
request's blocks a moment after the client went away, never synchronously.

The test modules import these helpers and wrap them in their own fixtures (``tests/e2e/conftest.py``
belongs to the Redis fixtures).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import GenerationOutput
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.server.app import build_app
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.middleware import DEFAULT_MAX_REQUEST_BYTES

MODEL_NAME = "tiny"
START_TIMEOUT_S = 20.0


def write_endless_model(path: Path) -> Path:
    """A tiny random model with no end-of-sequence token: every sample runs to ``max_tokens``,
    so token counts are exact and a long generation stays in flight until it is aborted."""
    return write_tiny_model(path, eos_token_id=None)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(slots=True)
class ServerHandle:
    """A server running in this process: its URL and the engine behind it."""

    base_url: str  # "http://127.0.0.1:PORT"
    engine: AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread
    api_key: str | None

    @property
    def v1(self) -> str:
        return f"{self.base_url}/v1"

    def num_used_blocks(self) -> int:
        """Blocks held by requests now (read under the engine lock: the step thread mutates)."""
        with self.engine._lock:
            return self.engine.engine.scheduler.manager.pool.num_used_blocks

    def num_in_flight(self) -> int:
        """Requests the server streams to (or collects for) a client now."""
        with self.engine._lock:
            return len(self.engine._streams)

    def num_unfinished(self) -> int:
        """Requests the engine has not finished (aborts apply before the next step)."""
        with self.engine._lock:
            return self.engine.engine.num_unfinished_requests

    def check_invariants(self) -> None:
        self.engine.check_invariants()

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Wait until no request is in flight and no block is held; raise if that never comes."""
        wait_until(
            lambda: self.num_in_flight() == self.num_unfinished() == self.num_used_blocks() == 0,
            timeout_s,
            lambda: (
                f"in flight {self.num_in_flight()}, unfinished {self.num_unfinished()}, "
                f"used blocks {self.num_used_blocks()}"
            ),
        )


def wait_until(
    cond: Callable[[], bool], timeout_s: float, describe: Callable[[], str] = lambda: ""
) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not met within {timeout_s} s: {describe()}")
        time.sleep(0.01)


@contextmanager
def running_server(
    model_dir: Path,
    *,
    config: EngineConfig | None = None,
    api_key: str | None = None,
    max_pending: int = 256,
    model_name: str = MODEL_NAME,
    min_step_s: float = 0.0,
    stall_timeout_s: float = 60.0,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
) -> Iterator[ServerHandle]:
    """Serve ``model_dir`` on 127.0.0.1 until the ``with`` block ends. ``min_step_s`` (fault
    injection: a slower model) makes every engine step last at least that long, so a long
    generation outlasts a test's waits however fast the engine is."""
    engine = LLMEngine.from_model_dir(str(model_dir), config or EngineConfig())
    if min_step_s > 0:
        real_step = engine.step

        def slow_step() -> list[GenerationOutput]:
            start = time.monotonic()
            out = real_step()
            time.sleep(max(0.0, min_step_s - (time.monotonic() - start)))
            return out

        engine.step = slow_step  # type: ignore[method-assign]
    async_engine = AsyncEngine(
        engine, max_pending=max_pending, model_name=model_name, stall_timeout_s=stall_timeout_s
    )
    app = build_app(
        async_engine,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        tool_call_parser=tool_call_parser,
        enable_auto_tool_choice=enable_auto_tool_choice,
    )
    port = free_port()
    uv_config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="on", timeout_keep_alive=5
    )
    server = uvicorn.Server(uv_config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    handle = ServerHandle(f"http://127.0.0.1:{port}", async_engine, server, thread, api_key)
    try:
        wait_until(
            lambda: server.started or not thread.is_alive(),
            START_TIMEOUT_S,
            lambda: "uvicorn did not start",
        )
        if not server.started:
            raise RuntimeError(f"uvicorn exited before serving on port {port}")
        yield handle
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        if thread.is_alive():  # a stuck stream: force the shutdown rather than hang the suite
            server.force_exit = True
            thread.join(timeout=5)
        async_engine.shutdown()


@contextmanager
def openai_client(model_dir: Path, config: EngineConfig | None = None) -> Iterator[openai.OpenAI]:
    """The official ``openai`` client (no retries, 30 s timeout) of a :func:`running_server`
    on ``model_dir``; both closed when the ``with`` block ends."""
    with (
        running_server(model_dir, config=config) as handle,
        openai.OpenAI(base_url=handle.v1, api_key="unused", max_retries=0, timeout=30) as c,
    ):
        yield c


def get(handle: ServerHandle, path: str, *, token: str | None = None) -> httpx.Response:
    """One GET with an optional Bearer token, bounded in time."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    return httpx.get(f"{handle.base_url}{path}", headers=headers, timeout=10)


@contextmanager
def spawned_server(
    model: Path,
    log_path: Path,
    extra_args: Sequence[str] = (),
    *,
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``pagedkv serve --model MODEL`` as a child process on a free port; yields its base URL
    once ``/health`` answers, and the process. Stops it (SIGTERM, then SIGKILL) afterwards."""
    port = free_port()
    cmd = [sys.executable, "-c", "import sys; from pagedkv.cli import main; sys.exit(main())"]
    args = ["serve", "--model", str(model), "--port", str(port), "--log-level", "warning"]
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [*cmd, *args, *extra_args],
            env={**os.environ, **(env or {})},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"pagedkv serve exited with {proc.returncode}: {log_path.read_text()}")
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("pagedkv serve did not answer /health within 60 s")
            time.sleep(0.1)
        yield base, proc
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
