"""vLLM's request-phase histograms (queue, prefill, decode, inference, time per output token)
with vLLM's bucket layout, measured on real uvicorn with a slowed model step; and a 429 (more
than ``max_pending`` requests) counted under the request-status metric."""

from __future__ import annotations

import re
import threading
import time
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


def test_phase_histograms_measure_queue_prefill_and_decode(tmp_path: Path) -> None:
    model = write_endless_model(tmp_path / "m")
    cfg = EngineConfig(max_num_seqs=1)  # the second request waits for the first
    with running_server(model, config=cfg, min_step_s=STEP_S) as srv:
        threads = [threading.Thread(target=_complete, args=(srv, 6)) for _ in range(2)]
        threads[0].start()
        deadline = time.monotonic() + 10
        while srv.engine.engine.scheduler.num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.002)  # the second arrives while the first runs, so it must queue
        threads[1].start()
        for t in threads:
            t.join()
        srv.wait_idle()
        text = httpx.get(f"{srv.base_url}/metrics").text
    for family in ("queue", "prefill", "decode", "inference"):
        name = f"vllm:request_{family}_time_seconds"
        assert _value(text, f"{name}_count{{{LABEL}}}") == 2
        edges = re.findall(rf'^{name}_bucket{{le="([^"]+)",{LABEL}}}', text, re.MULTILINE)
        assert edges == VLLM_LATENCY_EDGES
    # 6 tokens: the first at the end of prefill, 5 more decode steps each >= STEP_S
    decode = _value(text, f"vllm:request_decode_time_seconds_sum{{{LABEL}}}")
    assert decode >= 2 * 5 * STEP_S * 0.95
    prefill = _value(text, f"vllm:request_prefill_time_seconds_sum{{{LABEL}}}")
    assert prefill >= 2 * STEP_S * 0.95
    # the second arrived while the first ran (max_num_seqs = 1), so it queued for at least one
    # of the first's steps; how many depends on how late its HTTP request lands on a loaded
    # machine (0.07-0.15 s measured), so the bound is one step
    assert _value(text, f"vllm:request_queue_time_seconds_sum{{{LABEL}}}") >= STEP_S
    inference = _value(text, f"vllm:request_inference_time_seconds_sum{{{LABEL}}}")
    assert inference == pytest.approx(prefill + decode)
    tpot = "vllm:request_time_per_output_token_seconds"
    assert _value(text, f"{tpot}_count{{{LABEL}}}") == 2
    assert _value(text, f"{tpot}_sum{{{LABEL}}}") == pytest.approx(decode / 5)
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
