"""Prefill/decode disaggregation: a prefill engine and a decode engine sharing a real Redis.

``pagedkv router --prefill P --engine D``: the prefill engine computes each prompt's KV and
stores it in Redis; the decode engine loads it (its ``cached_tokens`` count the loaded prefix)
and streams the output, which equals a single engine's. With the prefill engine gone, the
decode engine computes everything itself and the answer is still the same.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from e2e.processes import Proc, spawn, wait_ready
from e2e.server_fixtures import write_endless_model
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampler import SamplingParams

pytestmark = pytest.mark.redis

RedisServer = Any  # tests/e2e/conftest.py's RedisServer

BLOCK_SIZE = 16
MAX_TOKENS = 8


@pytest.fixture
def pd_pair(redis_server: RedisServer, tmp_path: Path) -> Iterator[dict[str, Any]]:
    model = write_endless_model(tmp_path / "model")
    common = ["serve", "--model", str(model), "--threads", "1", "--served-model-name", "tiny",
              "--block-size", str(BLOCK_SIZE), "--num-blocks", "128", "--redis", redis_server.url,
              "--kv-events", "tcp://127.0.0.1:*"]  # fmt: skip
    procs: list[Proc] = [
        spawn([*common, "--role", "prefill"], tmp_path / "prefill.log"),
        spawn([*common, "--role", "decode"], tmp_path / "decode.log"),
    ]
    try:
        for p in procs:
            wait_ready(p)
        prefill, decode = procs
        router = spawn(
            ["router", "--prefill", prefill.url, "--engine", decode.url, "--poll-interval", "0.2"],
            tmp_path / "router.log",
        )
        procs.append(router)
        wait_ready(router)
        yield {"model": model, "prefill": prefill, "decode": decode, "router": router}
    finally:
        for p in reversed(procs):
            p.stop()


def _prompt(seed: int) -> list[int]:
    return [(seed * 61 + i * 29) % 250 + 3 for i in range(6 * BLOCK_SIZE + 5)]  # 6 full blocks


def _stream(base: str, prompt: list[int]) -> tuple[str, int]:
    """Streamed text and cached prompt tokens of one greedy completion."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    text, cached = "", -1
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["x-pagedkv-engine"]
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            text += "".join(c.get("text", "") for c in event["choices"])
            if event.get("usage"):
                cached = event["usage"]["prompt_tokens_details"]["cached_tokens"]
    return text, cached


def test_decode_engine_loads_the_prefill_engines_kv_and_answers_the_same(
    pd_pair: dict[str, Any],
) -> None:
    prompts = [_prompt(1), _prompt(2)]
    llm = LLM(str(pd_pair["model"]), block_size=BLOCK_SIZE, num_blocks=128)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    expected = [o.outputs[0].text for o in llm.generate(prompts, sp, progress=False)]
    base = pd_pair["router"].url

    text, cached = _stream(base, prompts[0])
    assert text == expected[0]
    assert cached == 6 * BLOCK_SIZE  # every full block came from Redis, none was computed
    stats = httpx.get(f"{base}/router/stats", timeout=5).json()
    assert (stats["num_prefills"], stats["num_prefill_failures"]) == (1, 0)

    pd_pair["prefill"].stop(signal.SIGKILL)  # the transfer fails from now on
    text, cached = _stream(base, prompts[1])
    assert text == expected[1]  # the decode engine recomputed the prompt
    assert cached == 0
    stats = httpx.get(f"{base}/router/stats", timeout=5).json()
    assert stats["num_prefill_failures"] == 1
    assert stats["num_failed"] == 0
