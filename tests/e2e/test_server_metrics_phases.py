"""vLLM's request-phase histograms (queue, prefill, decode, inference, time per output token)
with vLLM's bucket layout, measured on real uvicorn with a slowed model step; and a 429 (more
than ``max_pending`` requests) counted under the request-status metric."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from e2e.server_fixtures import MODEL_NAME, ServerHandle, running_server, write_endless_model
from pagedkv.engine.engine_config import EngineConfig

pytestmark = pytest.mark.engine

STEP_S = 0.03  # every engine step lasts at least this long
LABEL = f'model_name="{MODEL_NAME}"'
VLLM_LATENCY_EDGES = ["0.3", "0.5", "0.8", "1.0", "1.5", "2.0", "2.5", "5.0", "10.0", "15.0",
                      "20.0", "30.0", "40.0", "50.0", "60.0", "120.0", "240.0", "480.0", "960.0",
                      "1920.0", "7680.0", "+Inf"]  # fmt: skip


def _value(text: str, sample: str) -> float:
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    assert m is not None, sample
    return float(m.group(1))


def _complete(srv: ServerHandle, max_tokens: int) -> None:
    body = {"model": MODEL_NAME, "prompt": "a b c", "max_tokens": max_tokens}
    r = httpx.post(f"{srv.v1}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


FIRST_TOKENS = 30  # long enough that the second request lands while the first still runs
SECOND_TOKENS = 6


def _wait_until(cond: Callable[[], bool], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_phase_histograms_measure_queue_prefill_and_decode(tmp_path: Path) -> None:
    model = write_endless_model(tmp_path / "m")
    cfg = EngineConfig(max_num_seqs=1)  # the second request waits for the first
    with running_server(model, config=cfg, min_step_s=STEP_S) as srv:
        sched = srv.engine.engine.scheduler
        first = threading.Thread(target=_complete, args=(srv, FIRST_TOKENS))
        second = threading.Thread(target=_complete, args=(srv, SECOND_TOKENS))
        first.start()
        _wait_until(lambda: sched.num_running == 1)
        second.start()
        _wait_until(lambda: sched.num_waiting == 1)  # the second has arrived and queues
        # observed, not assumed: how many tokens the first still had to make when the second
        # queued; each one is a step of >= STEP_S the second waits through
        running = list(sched.running)
        left = FIRST_TOKENS - running[0].num_output_tokens if running else 0
        first.join()
        second.join()
        srv.wait_idle()
        text = httpx.get(f"{srv.base_url}/metrics").text
    for family in ("queue", "prefill", "decode", "inference"):
        name = f"vllm:request_{family}_time_seconds"
        assert _value(text, f"{name}_count{{{LABEL}}}") == 2
        edges = re.findall(rf'^{name}_bucket{{le="([^"]+)",{LABEL}}}', text, re.MULTILINE)
        assert edges == VLLM_LATENCY_EDGES
    # n tokens: the first at the end of prefill, n - 1 more decode steps each >= STEP_S
    decode_steps = FIRST_TOKENS - 1 + SECOND_TOKENS - 1
    decode = _value(text, f"vllm:request_decode_time_seconds_sum{{{LABEL}}}")
    assert decode >= decode_steps * STEP_S * 0.95
    prefill = _value(text, f"vllm:request_prefill_time_seconds_sum{{{LABEL}}}")
    assert prefill >= 2 * STEP_S * 0.95
    # the second queued until the first's last token: at least (left - 1) whole steps
    queue = _value(text, f"vllm:request_queue_time_seconds_sum{{{LABEL}}}")
    assert queue >= (left - 1) * STEP_S * 0.95
    assert left >= 2, f"the second request landed late (the first had {left} tokens left)"
    inference = _value(text, f"vllm:request_inference_time_seconds_sum{{{LABEL}}}")
    assert inference == pytest.approx(prefill + decode)
    tpot = "vllm:request_time_per_output_token_seconds"
    assert _value(text, f"{tpot}_count{{{LABEL}}}") == 2
    # time per output token is decode time / (n - 1), one sample per request
    assert _value(text, f"{tpot}_sum{{{LABEL}}}") >= 2 * STEP_S * 0.95
    assert f"vllm:num_preemptions_total{{{LABEL}}}" in text


def test_a_429_is_counted_under_the_request_status_metric(tmp_path: Path) -> None:
    model = write_endless_model(tmp_path / "m")
    with running_server(model, max_pending=1, min_step_s=STEP_S) as srv:
        body = {"model": MODEL_NAME, "prompt": "a", "max_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{srv.v1}/completions", json=body, timeout=60) as busy:
            assert busy.status_code == 200
            lines = busy.iter_lines()  # kept: dropping it closes the connection
            next(lines)  # the first request is in flight
            over = httpx.post(f"{srv.v1}/completions", json={**body, "stream": False})
            assert over.status_code == 429
            assert over.headers["retry-after"] == "1"
            assert over.json()["error"]["type"] == "rate_limit_error"
            assert any(line == "data: [DONE]" for line in lines)  # the first one went on
        srv.wait_idle()
        text = httpx.get(f"{srv.base_url}/metrics").text
    status = 'pagedkv_http_requests_total{route="/v1/completions",status="%s"}'
    assert _value(text, status % "429") == 1
    assert _value(text, status % "200") == 1
