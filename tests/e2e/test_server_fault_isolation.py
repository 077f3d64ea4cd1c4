"""Over real HTTP with the official client: one bad request fails only itself.

Each case runs innocent greedy streams beside one guilty request, in the same batches, and checks
that every innocent stream finishes with the text it gets alone and the server keeps serving:
- sampling values at the edge of float32 (``temperature=1e-38``, ``top_p=1e-46``): now valid,
  and sampled (greedily: the limit of both);
- NaN logits for the guilty request (fault injection in the model runner);
- a model step that raises whenever the guilty request is in the batch (fault injection): the
  engine bisects the batch, so only the guilty request fails;
- a tier load that raises (fault injection): the loading requests recompute their prefix and
  give the text they gave before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from e2e.server_fixtures import MODEL_NAME, ServerHandle, running_server, write_endless_model
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.tiers import TierConfig

pytestmark = pytest.mark.engine

NUM_INNOCENT = 16
MAX_TOKENS = 8
GUILTY_PROMPT = "zzzz the guilty request"
SHARED = "a shared system prompt that spans several kv blocks, for the tier to hold:"
PROMPTS = [f"innocent request number {i}: tell me" for i in range(NUM_INNOCENT)]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    model = write_endless_model(tmp_path_factory.mktemp("srv-faults") / "m")
    cfg = EngineConfig(check_invariants=True, max_num_seqs=64)
    with running_server(model, config=cfg, min_step_s=0.01) as handle:
        yield handle


@pytest.fixture(scope="module")
def alone(srv: ServerHandle) -> dict[str, str]:
    """Each innocent prompt's greedy text, one request at a time."""
    with openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=60) as oc:
        return {
            p: oc.completions.create(
                model=MODEL_NAME, prompt=p, max_tokens=MAX_TOKENS, temperature=0
            )
            .choices[0]
            .text
            for p in PROMPTS
        }


def _stream(oc: openai.OpenAI, prompt: str, **sampling: Any) -> tuple[str, str | None]:
    """Stream one completion; returns its text and finish_reason."""
    text, reason = "", None
    for chunk in oc.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, stream=True, **sampling
    ):
        for c in chunk.choices:
            text += c.text
            reason = c.finish_reason or reason
    return text, reason


def _run_together(srv: ServerHandle, guilty: Callable[[openai.OpenAI], Any]) -> dict[str, Any]:
    """Start the innocent streams and the guilty request at once (a barrier), so they share
    batches; returns each one's result (or the exception it raised)."""
    results: dict[str, Any] = {}
    barrier = threading.Barrier(NUM_INNOCENT + 1)

    def worker(key: str, fn: Callable[[openai.OpenAI], Any]) -> None:
        with openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=60) as oc:
            barrier.wait()
            try:
                results[key] = fn(oc)
            except Exception as exc:
                results[key] = exc

    threads = [
        threading.Thread(target=worker, args=(p, lambda oc, p=p: _stream(oc, p, temperature=0)))
        for p in PROMPTS
    ]
    threads.append(threading.Thread(target=worker, args=("guilty", guilty)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    srv.wait_idle()
    srv.check_invariants()
    return results


def _check_innocent(results: dict[str, Any], alone: dict[str, str]) -> None:
    for p in PROMPTS:
        assert results[p] == (alone[p], "length"), p


@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 1e-38}, {"top_p": 1e-46}, {"temperature": 1e-30, "top_p": 1.4e-45}],
    ids=["tiny-temperature", "tiny-top-p", "both"],
)
def test_float32_edge_sampling_values_fail_nobody(
    srv: ServerHandle, alone: dict[str, str], sampling: dict[str, Any]
) -> None:
    results = _run_together(srv, lambda oc: _stream(oc, PROMPTS[0], seed=3, **sampling))
    _check_innocent(results, alone)
    assert results["guilty"] == (alone[PROMPTS[0]], "length")  # greedy in the limit


def _guilty_ids(srv: ServerHandle) -> list[int]:
    tok = srv.engine.engine.tokenizer
    assert tok is not None
    return tok.encode(GUILTY_PROMPT)


def test_nan_logits_fail_only_their_request(
    srv: ServerHandle, alone: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = srv.engine.engine.runner
    real = runner.execute
    guilty_ids = _guilty_ids(srv)

    def nan_for_guilty(batch: Any) -> dict[str, torch.Tensor]:
        logits = real(batch)
        for s in batch.scheduled:
            req = srv.engine.engine.scheduler.requests.get(s.request_id)
            if (
                s.request_id in logits
                and req is not None
                and req.all_token_ids[:4] == guilty_ids[:4]
            ):
                logits[s.request_id] = torch.full_like(logits[s.request_id], float("nan"))
        return logits

    monkeypatch.setattr(runner, "execute", nan_for_guilty)
    results = _run_together(srv, lambda oc: _stream(oc, GUILTY_PROMPT, temperature=0.7))
    _check_innocent(results, alone)
    assert results["guilty"] == ("", "error")


def test_a_step_raising_for_one_request_fails_only_it(
    srv: ServerHandle, alone: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = srv.engine.engine.runner
    real = runner.execute
    guilty_ids = _guilty_ids(srv)
    sizes: list[int] = []

    def raising_with_guilty(batch: Any) -> dict[str, torch.Tensor]:
        sizes.append(len(batch.scheduled))
        for s in batch.scheduled:
            if s.start_position == 0 and s.token_ids[:4] == guilty_ids[:4]:
                raise RuntimeError("simulated kernel failure")
        return real(batch)

    monkeypatch.setattr(runner, "execute", raising_with_guilty)
    results = _run_together(srv, lambda oc: _stream(oc, GUILTY_PROMPT))
    _check_innocent(results, alone)
    assert results["guilty"] == ("", "error")
    assert 1 in sizes  # the guilty request ran alone (and failed) after a bisection
    with openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=60) as oc:
        monkeypatch.setattr(runner, "execute", real)
        after = _stream(oc, GUILTY_PROMPT, temperature=0)
        assert after[1] == "length"  # the server goes on; the request itself was never bad


def test_a_tier_load_that_raises_recomputes_with_the_same_text(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_endless_model(tmp_path / "m")
    cfg = EngineConfig(check_invariants=True, block_size=4, tiers=TierConfig(host_bytes=16 << 20))
    prompts = [f"{SHARED} question {i}" for i in range(6)]
    with running_server(model, config=cfg) as srv:
        tio = srv.engine.engine.tier_io
        assert tio is not None
        tio.measure_recompute = False  # always load what the tier holds
        with openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=60) as oc:
            first = {p: _stream(oc, p, temperature=0) for p in prompts}
            assert tio.offload.flush(10.0)
            with srv.engine._lock:
                srv.engine.engine.scheduler.manager.reset_prefix_cache()

            def broken(*_: Any) -> Any:
                raise ConnectionError("simulated tier failure mid-load")

            monkeypatch.setattr(tio.offload, "load", broken)
            results: dict[str, tuple[str, str | None]] = {}
            threads = [
                threading.Thread(
                    target=lambda p=p: results.__setitem__(p, _stream(oc, p, temperature=0))
                )
                for p in prompts
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        assert results == first
        assert all(reason == "length" for _, reason in first.values())
        assert tio.num_failed_loads > 0
        assert srv.engine.engine.scheduler.num_loaded_blocks == 0
        srv.wait_idle()
        srv.check_invariants()
