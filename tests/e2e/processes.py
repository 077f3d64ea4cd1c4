"""``pagedkv`` commands as child processes on free loopback ports (engines, routers), for the
multi-process end-to-end tests: each process has its own interpreter and one torch thread."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from e2e.server_fixtures import free_port

CLI = [sys.executable, "-c", "import sys; from pagedkv.cli import main; sys.exit(main())"]


@dataclass(slots=True)
class Proc:
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def spawn(args: list[str], log: Path) -> Proc:
    """``pagedkv ARGS --port P`` in the background (logging to ``log``); wait_ready() next."""
    port = free_port()
    with log.open("w") as f:
        proc = subprocess.Popen(
            [*CLI, *args, "--port", str(port), "--log-level", "warning"],
            stdout=f,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
    return Proc(f"http://127.0.0.1:{port}", proc, log)


def wait_ready(p: Proc, path: str = "/health", timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if p.proc.poll() is not None:
            pytest.fail(f"{p.url} exited with {p.proc.returncode}: {p.log.read_text()[-3000:]}")
        try:
            if httpx.get(p.url + path, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    pytest.fail(f"{p.url} did not answer {path} within {timeout_s} s")
