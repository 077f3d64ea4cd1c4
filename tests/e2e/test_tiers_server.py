"""KV tier flags end to end: ``pagedkv serve`` and ``pagedkv generate`` with real tier folders.

The server runs as a real ``pagedkv serve`` process: /metrics must show per-tier counters after
a request, and a SIGTERM (uvicorn's graceful shutdown, then the app's lifespan) must leave the
request's blocks on disk (the tiers are flushed and closed on shutdown).
"""

from __future__ import annotations

import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from e2e.server_fixtures import spawned_server, write_endless_model
from pagedkv.engine.cli import generate_main
from pagedkv.server.cli import build_parser
from pagedkv.tiers.config import TierConfig, tier_config_from_args

PROMPT = [(i * 37) % 300 + 5 for i in range(300)]  # 18 full blocks of 16


def _block_files(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file() and p.parent != folder]


def _metric(text: str, name: str, tier: str) -> float:
    m = re.search(rf'^{name}{{tier="{tier}"}} ([0-9.e+]+)$', text, re.MULTILINE)
    assert m is not None, f"{name}{{tier={tier!r}}} not in /metrics"
    return float(m.group(1))


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_endless_model(tmp_path / "m")


@pytest.fixture
def served(model: Path, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    tiers = ["--host-tier-bytes", "8M", "--disk-tier", str(tmp_path / "kv")]
    tiers += ["--disk-tier-bytes", "64M"]
    with spawned_server(model, tmp_path / "serve.log", tiers) as served_proc:
        yield served_proc


def test_serve_exports_tier_metrics_and_flushes_the_disk_tier_on_shutdown(
    served: tuple[str, subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    base, proc = served
    body = {"model": "m", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while True:  # the writer thread fills the tiers a moment after the step
        text = httpx.get(f"{base}/metrics", timeout=10).text
        written = _metric(text, "pagedkv_tier_written_bytes_total", "disk")
        if written > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert _metric(text, "pagedkv_tier_written_bytes_total", "host") > 0
    assert written > 0
    assert _metric(text, "pagedkv_tier_hits_blocks_total", "disk") == 0
    proc.terminate()  # SIGTERM: graceful shutdown, the lifespan closes the tiers
    # uvicorn re-raises the signal once its graceful shutdown (and our lifespan) is done
    assert proc.wait(timeout=30) in (0, -signal.SIGTERM)
    assert len(_block_files(tmp_path / "kv")) >= len(PROMPT) // 16


def test_serve_flags_build_the_tier_config() -> None:
    argv = ["--model", "m", "--host-tier-bytes", "1G", "--disk-tier", "/x"]
    argv += ["--disk-tier-bytes", "2G", "--redis", "redis://h:1/0", "--redis-ttl", "60"]
    args = build_parser().parse_args([*argv, "--disk-tier-fsync", "file"])
    assert tier_config_from_args(args) == TierConfig(
        host_bytes=1 << 30,
        disk_dir="/x",
        disk_bytes=2 << 30,
        disk_fsync="file",
        redis_url="redis://h:1/0",
        redis_ttl_s=60,
    )
    assert tier_config_from_args(build_parser().parse_args(["--model", "m"])) is None


def test_generate_with_a_disk_tier_twice_reuses_it(model: Path, tmp_path: Path) -> None:
    kv = tmp_path / "kv"
    text = " ".join(["paged attention stores keys and values in blocks"] * 20)
    argv = ["--model", str(model), "--prompt", text, "--max-tokens", "4"]
    argv += ["--disk-tier", str(kv), "--disk-tier-bytes", "64M"]
    assert generate_main(argv) == 0
    files = _block_files(kv)
    assert files  # written through, flushed by close() before generate_main returned
    stamps = {p: p.stat().st_mtime_ns for p in files}
    time.sleep(0.02)
    assert generate_main(argv) == 0  # a second run reads them back (each read stamps the file)
    assert any(p.stat().st_mtime_ns > t for p, t in stamps.items())


def test_generate_rejects_a_disk_tier_without_a_budget(model: Path, tmp_path: Path) -> None:
    argv = ["--model", str(model), "--prompt", "hi", "--disk-tier", str(tmp_path / "kv")]
    with pytest.raises(SystemExit) as exc:  # a usage error, found before the model loads
        generate_main(argv)
    assert exc.value.code == 2
    assert not (tmp_path / "kv").exists()


@pytest.mark.parametrize("size", ["lots", "-1", "1X", ""])
def test_a_bad_tier_size_is_a_usage_error(size: str) -> None:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--model", "m", "--host-tier-bytes", size])
    assert exc.value.code == 2
