"""KV tiers across real processes: a disk tier survives a restart, a Redis tier is shared.

Each engine runs in its own ``python`` process (the worker below, driven over stdin/stdout in
JSON lines) on a tiny random checkpoint, with tiers built from ``LLM(...)`` options exactly as
a user would. Expected tokens come from an engine without tiers in the test process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedkv.engine.llm import LLM
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model

RedisServer = Any  # tests/e2e/conftest.py's RedisServer

MAX_TOKENS = 12
BLOCK_SIZE = 16

WORKER = textwrap.dedent(
    """
    import json, sys
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.sampler import SamplingParams

    block_size = int(sys.argv[3])
    llm = LLM(sys.argv[1], block_size=block_size, num_blocks=512, **json.loads(sys.argv[2]))
    tio = llm.engine.tier_io
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "exit":
            break
        reply = {}
        if cmd["op"] == "generate":
            sp = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, ignore_eos=True)
            out = llm.generate([cmd["prompt"]], sp, progress=False)[0]
            reply = {"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens}
        elif cmd["op"] == "flush":
            reply = {"flushed": tio.offload.flush(10.0)}
        elif cmd["op"] == "forget":  # the device pool drops every cached prefix
            reply = {"reset": llm.engine.scheduler.manager.reset_prefix_cache()}
        reply["tiers"] = {t.name: {
            "hits": t.hits, "bytes_in": t.bytes_in, "bytes_out": t.bytes_out,
            "errors": t.errors, "dropped": t.dropped_writes,
            "lookup_misses": t.lookup_misses,
        } for t in tio.tier_stats()}
        reply["loaded"] = llm.engine.scheduler.num_loaded_blocks
        print(json.dumps(reply), flush=True)
    llm.close()
    print(json.dumps({"closed": True}), flush=True)
    """
)


class Worker:
    """One engine process; ``call`` sends a command and returns its JSON reply."""

    def __init__(self, script: Path, model: Path, tiers: dict[str, Any]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(script), str(model), json.dumps(tiers), str(BLOCK_SIZE)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert self._read() == {"ready": True}

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            assert self.proc.stderr is not None
            self.proc.wait(10)
            err = self.proc.stderr.read()[-3000:]
            pytest.fail(f"worker exited with {self.proc.returncode}: {err}")
        result: dict[str, Any] = json.loads(line)
        return result

    def send(self, op: str, **kw: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        self.send(op, **kw)
        return self._read()

    def generate(self, prompt: list[int]) -> dict[str, Any]:
        return self.call("generate", prompt=prompt, max_tokens=MAX_TOKENS)

    def exit(self) -> int:
        """Ask the worker to close its LLM (flushing the tiers) and exit; its return code."""
        assert self.call("exit") == {"closed": True}
        return self.proc.wait(30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("worker") / "worker.py"
    path.write_text(WORKER, encoding="utf-8")
    return path


@pytest.fixture
def workers() -> Iterator[list[Worker]]:
    started: list[Worker] = []
    yield started
    for w in started:
        w.kill()


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 300 + 5 for i in range(n)]


def _expected(model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy tokens from an engine with no tier (every block computed)."""
    llm = LLM(str(model), block_size=BLOCK_SIZE, num_blocks=512)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, progress=False)]


def test_a_restarted_process_gets_the_prefix_from_the_disk_tier(
    model_dir: Path, script: Path, tmp_path: Path, workers: list[Worker]
) -> None:
    tiers = {"disk_tier": str(tmp_path / "kv"), "disk_tier_bytes": 64 << 20}
    prompt = _prompt(1, 700)  # 43 full blocks
    (expected,) = _expected(model_dir, [prompt])

    first = Worker(script, model_dir, tiers)
    workers.append(first)
    out1 = first.generate(prompt)
    assert out1["tokens"] == expected
    assert out1["cached"] == 0
    assert first.exit() == 0  # close() wrote every queued block
    files = [p for p in (tmp_path / "kv").rglob("*") if p.is_file() and p.suffix != ".lock"]
    assert len(files) >= 700 // BLOCK_SIZE

    second = Worker(script, model_dir, tiers)
    workers.append(second)
    out2 = second.generate(prompt)
    assert out2["tokens"] == expected
    assert out2["cached"] >= (700 // BLOCK_SIZE - 1) * BLOCK_SIZE  # all but the last block
    assert out2["tiers"]["disk"]["hits"] >= 700 // BLOCK_SIZE - 1
    assert out2["loaded"] >= 700 // BLOCK_SIZE - 1
    assert second.exit() == 0


@pytest.mark.redis
def test_two_processes_share_a_prefix_through_redis_and_survive_its_loss(
    model_dir: Path,
    script: Path,
    redis_server: RedisServer,
    workers: list[Worker],
) -> None:
    tiers = {"redis_url": redis_server.url}
    shared = _prompt(2, 400)
    prompts = [shared, shared + _prompt(3, 40), shared + _prompt(4, 40), _prompt(5, 300)]
    expected = _expected(model_dir, prompts)

    a = Worker(script, model_dir, tiers)
    b = Worker(script, model_dir, tiers)
    workers.extend([a, b])
    out_a = a.generate(shared)
    assert out_a["tokens"] == expected[0]
    flushed = a.call("flush")
    assert flushed["flushed"] is True
    assert flushed["tiers"]["redis"]["bytes_in"] > 0

    out_b = b.generate(shared)  # B never computed it: the blocks come from A through Redis
    assert out_b["tokens"] == expected[0]
    assert out_b["tiers"]["redis"]["hits"] >= 400 // BLOCK_SIZE - 1
    assert out_b["cached"] >= (400 // BLOCK_SIZE - 1) * BLOCK_SIZE

    # the server goes away while both are serving: a request is in flight in each
    for w in (a, b):
        w.call("forget")  # so the next prompts would need the tier
        w.send("generate", prompt=prompts[1], max_tokens=MAX_TOKENS)
    redis_server.stop()
    for w in (a, b):
        out = w._read()
        assert out["tokens"] == expected[1]
    for w in (a, b):
        before = w.call("forget")["tiers"]["redis"]
        out2 = w.generate(prompts[2])
        out3 = w.generate(prompts[3])
        assert out2["tokens"] == expected[2]
        assert out3["tokens"] == expected[3]
        after = out3["tiers"]["redis"]
        assert after["hits"] == before["hits"]  # nothing served by the dead server
        assert after["errors"] + after["dropped"] + after["lookup_misses"] > (
            before["errors"] + before["dropped"] + before["lookup_misses"]
        )
    assert a.exit() == 0
    assert b.exit() == 0


def test_a_process_that_never_calls_close_still_flushes_the_disk_tier(
    model_dir: Path, tmp_path: Path
) -> None:
    kv = tmp_path / "kv"
    code = textwrap.dedent(
        """
        import sys
        from pagedkv.engine.llm import LLM
        from pagedkv.engine.sampler import SamplingParams
        from pagedkv.tiers import TierConfig

        # fsync per file and folder: slow writes, still queued when generate() returns
        tiers = TierConfig(disk_dir=sys.argv[2], disk_bytes=1 << 26, disk_fsync="file+dir")
        llm = LLM(sys.argv[1], block_size=16, tiers=tiers)
        llm.generate([list(range(5, 300))], SamplingParams(max_tokens=1), progress=False)
        """  # no close(): the finalizer flushes at interpreter exit (without it: 0 to 5 files)
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(model_dir), str(kv)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(list(kv.rglob("*.kvb"))) == 295 // BLOCK_SIZE
