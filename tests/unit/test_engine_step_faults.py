"""One request that breaks a step fails only itself; everyone else gets the tokens they get alone.

Pinned on the tiny model, greedy, with fault injection (fakes that make one request's model run
raise, give it NaN logits, or make a tier load raise):
- sampling values at the edge of float32 (``temperature`` 1e-38, ``top_p`` 1e-46) sample;
- NaN logits of one request fail it alone;
- a model step that raises because of one request is bisected: it alone fails;
- a tier load that raises makes its requests recompute (never commit unfilled blocks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.step_faults import nonfinite_requests
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.errors import ModelExecutionError
from pagedkv.tiers import TierConfig

pytestmark = pytest.mark.engine

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
PROMPTS = {f"r{i}": [5 + i, 17, 23 + 2 * i, 9, 41, 3 + i, 11] for i in range(8)}
POISON = 97  # a request whose prompt starts with this token makes the model run raise


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-faults") / "m", eos_token_id=None)


def _engine(model_dir: Path, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(
        **{"block_size": 4, "num_blocks": 256, "max_model_len": 128, "check_invariants": True} | kw
    )
    return LLMEngine.from_model_dir(str(model_dir), cfg)


def _run(
    engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]
) -> dict[str, Any]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_invariants()
    assert engine.scheduler.manager.pool.num_used_blocks == 0
    return done


@pytest.fixture(scope="module")
def alone(model_dir: Path) -> dict[str, list[int]]:
    """Each prompt's greedy tokens, run on its own engine."""
    tokens = {}
    for rid, prompt in PROMPTS.items():
        out = _run(_engine(model_dir), {rid: (prompt, GREEDY)})[rid]
        tokens[rid] = list(out.outputs[0].token_ids)
    return tokens


def _tokens(done: dict[str, Any], rid: str) -> list[int]:
    return list(done[rid].outputs[0].token_ids)


def test_float32_edge_sampling_values_sample_beside_greedy_requests(
    model_dir: Path, alone: dict[str, list[int]]
) -> None:
    edge = {
        "tiny-temp": SamplingParams(max_tokens=6, temperature=1e-38, seed=1),
        "tiny-top-p": SamplingParams(max_tokens=6, temperature=1.0, top_p=1e-46, seed=1),
        "both": SamplingParams(max_tokens=6, temperature=1e-30, top_p=1.4e-45, seed=1),
    }
    reqs = {rid: (p, GREEDY) for rid, p in PROMPTS.items()}
    reqs |= {rid: (PROMPTS["r0"], params) for rid, params in edge.items()}
    done = _run(_engine(model_dir), reqs)
    for rid in PROMPTS:
        assert _tokens(done, rid) == alone[rid]
    # a vanishing temperature is greedy; a vanishing top_p keeps only the best token: greedy too
    for rid in edge:
        assert done[rid].outputs[0].finish_reason == "length"
        assert _tokens(done, rid) == alone["r0"]


def test_nan_logits_of_one_request_fail_it_alone(
    model_dir: Path, alone: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model_dir)
    real = engine.runner.execute

    def nan_for_r3(batch: Any) -> dict[str, torch.Tensor]:
        logits = real(batch)
        if "r3" in logits:
            logits["r3"] = torch.full_like(logits["r3"], float("nan"))
        return logits

    monkeypatch.setattr(engine.runner, "execute", nan_for_r3)
    done = _run(engine, {rid: (p, GREEDY) for rid, p in PROMPTS.items()})
    assert done["r3"].outputs[0].finish_reason == "error"
    for rid in PROMPTS.keys() - {"r3"}:
        assert done[rid].outputs[0].finish_reason == "length"
        assert _tokens(done, rid) == alone[rid]


@pytest.mark.parametrize(
    "bad",
    [
        torch.tensor([[float("nan"), 0.0]]),
        torch.tensor([[float("inf"), 0.0]]),
        torch.tensor([[float("-inf"), float("-inf")]]),
        torch.tensor([[0.0, 1.0], [float("nan"), 1.0]]),  # a draft row of a speculative decode
    ],
)
@pytest.mark.parametrize("views", [False, True], ids=["tensors", "views of one"])
def test_non_finite_logits_are_found_per_request(bad: torch.Tensor, views: bool) -> None:
    ok = torch.tensor([[float("-inf"), 0.0]])  # -inf masks a token: legal
    parts = [ok, bad, ok.clone()]
    if views:  # as the runner hands them out: adjacent row ranges of one tensor
        whole, parts, start = torch.cat(parts), [], 0
        for n in (1, bad.shape[0], 1):
            parts.append(whole[start : start + n])
            start += n
    found = nonfinite_requests(dict(zip("abc", parts, strict=True)))
    assert set(found) == {"b"}
    assert isinstance(found["b"], ModelExecutionError)
    assert "non-finite" in str(found["b"])
    assert nonfinite_requests({}) == {}


@pytest.fixture
def poisoned(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[LLMEngine, list[int]]:
    """An engine whose model run raises whenever the batch holds the first position of a prompt
    starting with POISON (a fake for fault injection); yields it and each run's batch size."""
    engine = _engine(model_dir)
    real = engine.runner.execute
    sizes: list[int] = []

    def execute(batch: Any) -> dict[str, torch.Tensor]:
        sizes.append(len(batch.scheduled))
        for s in batch.scheduled:
            if s.start_position == 0 and s.token_ids[0] == POISON:
                raise RuntimeError("simulated kernel failure")
        return real(batch)

    monkeypatch.setattr(engine.runner, "execute", execute)
    return engine, sizes


def test_a_step_raising_for_one_request_fails_it_alone(
    poisoned: tuple[LLMEngine, list[int]], alone: dict[str, list[int]]
) -> None:
    engine, sizes = poisoned
    reqs = {rid: (p, GREEDY) for rid, p in PROMPTS.items()}
    reqs["guilty"] = ([POISON, 4, 5, 6, 7], GREEDY)
    done = _run(engine, reqs)
    assert done["guilty"].outputs[0].finish_reason == "error"
    assert done["guilty"].outputs[0].token_ids == ()
    for rid in PROMPTS:
        assert done[rid].outputs[0].finish_reason == "length"
        assert _tokens(done, rid) == alone[rid]
    # the first step ran 9 requests, failed, and was bisected: 9 -> 4 + 5 -> ...
    assert sizes[:3] == [9, 4, 5]
    assert 1 in sizes  # the guilty one ran alone, and failed


def test_a_batch_failure_that_needs_the_whole_batch_fails_nobody(
    model_dir: Path, alone: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model_dir)
    real = engine.runner.execute

    def fails_above_four(batch: Any) -> dict[str, torch.Tensor]:
        if len(batch.scheduled) > 4:
            raise RuntimeError("simulated out of memory for a big batch")
        return real(batch)

    monkeypatch.setattr(engine.runner, "execute", fails_above_four)
    done = _run(engine, {rid: (p, GREEDY) for rid, p in PROMPTS.items()})
    for rid in PROMPTS:
        assert _tokens(done, rid) == alone[rid]


@pytest.mark.parametrize("where", ["tier_io.load", "offload.load"])
def test_a_tier_load_that_raises_recomputes_with_the_same_tokens(
    model_dir: Path, alone: dict[str, list[int]], monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    engine = _engine(model_dir, tiers=TierConfig(host_bytes=16 << 20))
    tio = engine.tier_io
    assert tio is not None
    tio.measure_recompute = False  # always load what the tier holds
    try:
        first = _run(engine, {rid: (p, GREEDY) for rid, p in PROMPTS.items()})
        assert tio.offload.flush(10.0)
        engine.scheduler.manager.reset_prefix_cache()  # the device forgets every prefix

        def broken(*_: Any) -> Any:
            raise ConnectionError("simulated tier failure mid-load")

        target = tio if where == "tier_io.load" else tio.offload
        monkeypatch.setattr(target, "load", broken)
        again = {f"again-{rid}": (p, GREEDY) for rid, p in PROMPTS.items()}
        second = _run(engine, again)
        assert tio.num_failed_loads > 0
        assert engine.scheduler.num_loaded_blocks == 0
        for rid in PROMPTS:
            assert _tokens(first, rid) == alone[rid]
            assert _tokens(second, f"again-{rid}") == alone[rid]
    finally:
        engine.close()


def test_a_bisected_step_redoes_copy_on_write_copies_safely(
    poisoned: tuple[LLMEngine, list[int]], model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """n=2 samples fork after their prefill and copy their shared partial block on the first
    write; the guilty request arrives in that very step, so the copies run again in each rerun
    of the bisection. The samples still draw what they draw without the guilty request."""
    seeded = SamplingParams(max_tokens=6, temperature=0.8, seed=7, n=2)
    prompts = {rid: PROMPTS[rid] for rid in ("r0", "r1", "r2")}  # 7 tokens: a partial block

    def run(engine: LLMEngine, guilty: bool) -> dict[str, Any]:
        for rid, p in prompts.items():
            engine.add_request(rid, p, seeded)
        done: dict[str, Any] = {}
        first = True
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            if first and guilty:
                engine.add_request("guilty", [POISON, 1, 2, 3, 4, 5], GREEDY)
            first = False
            engine.check_invariants()
        return done

    base = run(_engine(model_dir), guilty=False)
    engine, sizes = poisoned
    copies: list[int] = []
    real = engine.runner.execute

    def recording(batch: Any) -> dict[str, torch.Tensor]:
        copies.append(len(batch.block_copies))
        return real(batch)

    monkeypatch.setattr(engine.runner, "execute", recording)
    done = run(engine, guilty=True)
    assert done["guilty"].outputs[0].finish_reason == "error"
    for rid in prompts:
        got = [c.token_ids for c in done[rid].outputs]
        assert got == [c.token_ids for c in base[rid].outputs]
    assert any(n > 1 for n in sizes[1:3])  # the second step was bisected ...
    assert max(copies) > 0  # ... and it carried copy-on-write copies into every rerun
