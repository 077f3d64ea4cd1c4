"""The batched sampler against per-token Python references: penalties (vLLM semantics),
logit_bias, min_tokens, min_p, grammar bitmasks, raw logprobs; and batching never changes what
a seeded request draws."""

from __future__ import annotations

import math
import random
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.batch_sampler import SampleInput, _processed, sample_batch, unpack_bitmask
from pagedkv.engine.sampler import SamplingParams, make_generator
from pagedkv.errors import InvalidRequestError

pytestmark = pytest.mark.engine

VOCAB = 24
CPU = torch.device("cpu")


def _ref_penalties(
    logits: list[float], prompt: list[int], output: list[int], p: SamplingParams
) -> list[float]:
    """vLLM's penalties, one token at a time: repetition over prompt + output, then
    frequency and presence over the output."""
    counts = Counter(output)
    seen = set(prompt) | set(output)
    out = []
    for tok, x in enumerate(logits):
        if tok in seen:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * counts[tok]
        x -= p.presence_penalty * (1 if counts[tok] else 0)
        out.append(x)
    return out


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    rep=st.floats(0.5, 2.0),
    freq=st.floats(-2.0, 2.0),
    pres=st.floats(-2.0, 2.0),
    num_rows=st.integers(1, 4),
)
def test_penalties_equal_per_token_reference(
    seed: int, rep: float, freq: float, pres: float, num_rows: int
) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    entries = []
    for r in range(num_rows):
        params = SamplingParams(
            repetition_penalty=rep if r % 2 == 0 else 1.0,
            frequency_penalty=freq,
            presence_penalty=pres if r != 1 else 0.0,
            temperature=0.0,
        )
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
        entries.append(
            SampleInput(torch.randn(1, VOCAB), params, make_generator(0, CPU), prompt, output)
        )
    starts = list(range(num_rows))
    raw = torch.cat([e.logits for e in entries])
    got = _processed(raw, entries, starts)
    for r, e in enumerate(entries):
        want = _ref_penalties(
            e.logits[0].tolist(), list(e.prompt_ids), list(e.output_ids), e.params
        )
        assert got[r].tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert torch.equal(raw, torch.cat([e.logits for e in entries]))  # the input is untouched


def test_logit_bias_adds_clamped_bias_and_can_force_a_token() -> None:
    params = SamplingParams(temperature=0.0, logit_bias={3: 250.0, 5: -7.5})
    assert params.logit_bias == ((3, 100.0), (5, -7.5))
    logits = torch.zeros(1, VOCAB)
    logits[0, 9] = 50.0
    got = _processed(logits, [SampleInput(logits, params, make_generator(0, CPU))], [0])
    want = logits.clone()
    want[0, 3] += 100.0
    want[0, 5] -= 7.5
    assert torch.equal(got, want)
    out = sample_batch([SampleInput(logits, params, make_generator(0, CPU))])
    assert out[0].token_ids == [3]


def test_min_tokens_suppresses_stop_ids_until_reached() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 2] = 30.0  # the end-of-sequence id is by far the most likely
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8)

    def draw(num_output: int) -> int:
        e = SampleInput(logits, params, make_generator(0, CPU), [1], [7] * num_output, (2, 4))
        return sample_batch([e])[0].token_ids[0]

    assert [draw(n) for n in range(5)] == [draw(0)] * 3 + [2, 2]
    assert draw(0) not in (2, 4)


def test_min_p_drops_unlikely_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    params = SamplingParams(min_p=0.2)  # keeps p >= 0.1: tokens 0, 1, 2
    drawn = {
        sample_batch([SampleInput(logits, params, make_generator(s, CPU))])[0].token_ids[0]
        for s in range(200)
    }
    assert drawn == {0, 1, 2}


def test_bitmask_allows_exactly_its_tokens() -> None:
    allowed = {1, 6, 31, 32, 40}
    words = torch.zeros(1, 2, dtype=torch.int64)
    for t in allowed:
        words[0, t // 32] |= 1 << (t % 32)
    mask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    assert set(unpack_bitmask(mask, 41)[0].nonzero()[:, 0].tolist()) == allowed
    logits = torch.randn(1, 41)
    for s in range(30):
        e = SampleInput(logits, SamplingParams(), make_generator(s, CPU), bitmask=mask[0])
        assert sample_batch([e])[0].token_ids[0] in allowed


def test_logprobs_are_raw_log_softmax_of_logits() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    params = SamplingParams(temperature=0.7, logprobs=5, presence_penalty=1.0)
    entries = [
        SampleInput(logits[i : i + 1], params, make_generator(i, CPU), [1], [2, 3])
        for i in range(3)
    ]
    outs = sample_batch(entries)
    ref = torch.log_softmax(logits.double(), dim=-1)
    for i, out in enumerate(outs):
        assert out.logprobs is not None
        (lp,) = out.logprobs
        assert lp.token_id == out.token_ids[0]
        assert lp.logprob == pytest.approx(float(ref[i, lp.token_id]), abs=1e-5)
        top_ids = [t for t, _ in lp.top]
        assert top_ids == ref[i].topk(5).indices.tolist()
        for t, v in lp.top:
            assert v == pytest.approx(float(ref[i, t]), abs=1e-5)
            assert math.isfinite(v)
    no = sample_batch([SampleInput(logits[:1], SamplingParams(), make_generator(0, CPU))])
    assert no[0].logprobs is None


def test_seeded_draws_do_not_depend_on_batch_mates() -> None:
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB)
    variants = [
        SamplingParams(temperature=0.8, top_k=5, seed=1),
        SamplingParams(temperature=1.2, top_p=0.6, seed=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, min_p=0.05, seed=3),
    ]

    def alone(i: int) -> int:
        e = SampleInput(logits[i : i + 1], variants[i], make_generator(i, CPU))
        return sample_batch([e])[0].token_ids[0]

    batch = [SampleInput(logits[i : i + 1], variants[i], make_generator(i, CPU)) for i in range(4)]
    assert [o.token_ids[0] for o in sample_batch(batch)] == [alone(i) for i in range(4)]


@pytest.mark.parametrize(
    "kw",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"repetition_penalty": 0.0},
        {"min_p": 1.5},
        {"min_tokens": 20, "max_tokens": 10},
        {"logprobs": 21},
        {"logit_bias": {-1: 1.0}},
    ],
)
def test_invalid_new_sampling_values_raise(kw: dict[str, object]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)  # type: ignore[arg-type]


def test_an_unsampleable_sequence_fails_alone_in_its_batch() -> None:
    logits = torch.randn(3, VOCAB)
    logits[1, 4] = float("nan")
    nothing = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)  # a mask allowing no token
    entries = [
        SampleInput(logits[0:1], SamplingParams(seed=1), make_generator(1, CPU)),
        SampleInput(logits[1:2], SamplingParams(seed=2), make_generator(2, CPU)),
        SampleInput(logits[2:3], SamplingParams(), make_generator(3, CPU), bitmask=nothing),
    ]
    ok, nan, empty = sample_batch(entries)
    assert ok.error is None
    assert len(ok.token_ids) == 1
    assert nan.error is not None
    assert "finite" in nan.error
    assert nan.token_ids == []
    assert empty.error is not None
    assert "no token is allowed" in empty.error
    alone = sample_batch([SampleInput(logits[0:1], SamplingParams(seed=1), make_generator(1, CPU))])
    assert ok.token_ids == alone[0].token_ids  # the failures did not disturb it


def test_checked_finite_logits_skip_only_the_raw_check() -> None:
    """``finite=True`` (the engine checked every row's max) draws the same tokens; a grammar
    mask that allows nothing is still reported, because processed logits are checked anyway."""
    logits = torch.randn(3, VOCAB)
    nothing = torch.zeros((VOCAB + 31) // 32, dtype=torch.int32)

    def entries(mask: torch.Tensor | None) -> list[SampleInput]:
        return [
            SampleInput(logits[r : r + 1], SamplingParams(seed=r), make_generator(r, CPU))
            for r in range(2)
        ] + [SampleInput(logits[2:3], SamplingParams(), make_generator(9, CPU), bitmask=mask)]

    plain = sample_batch(entries(None))
    checked = sample_batch(entries(None), finite=True)
    assert [o.token_ids for o in checked] == [o.token_ids for o in plain]
    assert all(o.error is None for o in checked)
    masked = sample_batch(entries(nothing), finite=True)
    assert masked[2].error is not None
    assert "no token is allowed" in masked[2].error
    assert [o.token_ids for o in masked[:2]] == [o.token_ids for o in plain[:2]]


def test_engine_fails_only_the_request_with_broken_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the runner returns NaN logits for one request; it finishes with
    ``error``, its batch-mate runs to completion and no block leaks."""
    from pagedkv.engine.engine_config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.tiny import write_tiny_model

    engine = LLMEngine.from_model_dir(
        str(write_tiny_model(tmp_path / "m", eos_token_id=None)), EngineConfig(num_blocks=64)
    )
    real = engine.runner.execute

    def poisoned(batch: Any) -> Any:
        out = real(batch)
        if "bad" in out:
            out["bad"] = torch.full_like(out["bad"], float("nan"))
        return out

    monkeypatch.setattr(engine.runner, "execute", poisoned)
    params = SamplingParams(max_tokens=5, temperature=0.8)
    engine.add_request("good", [5, 6, 7], params)
    engine.add_request("bad", [8, 9], params)
    final: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert final["bad"].outputs[0].finish_reason == "error"
    assert final["good"].outputs[0].finish_reason == "length"
    assert len(final["good"].outputs[0].token_ids) == 5
    assert engine.scheduler.manager.pool.num_used_blocks == 0
    engine.check_invariants()


def _run(engine: Any, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Any]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    final: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def test_speculation_skips_history_dependent_requests_and_keeps_greedy_tokens(
    tmp_path: Path,
) -> None:
    """With prompt-lookup drafting on, a penalised and a grammar-constrained request decode in
    the same batches as a plain one: the plain one gets drafts (and its greedy tokens do not
    change), the others get none and keep their semantics (penalties = the non-speculative
    run's tokens; the JSON parses)."""
    import json

    from pagedkv.engine.engine_config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.sampler import StructuredOutputsParams
    from pagedkv.engine.tiny import write_tiny_model

    model = str(write_tiny_model(tmp_path / "m", eos_token_id=None))
    loop = [5, 6, 7, 8] * 6  # a repetitive prompt: the n-gram proposer drafts from it
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    penalised = SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=1.0)
    schema = {"type": "object", "properties": {"k": {"enum": ["x", "y"]}}, "required": ["k"]}
    guided = SamplingParams(
        max_tokens=60, seed=3, structured_outputs=StructuredOutputsParams.from_schema(schema)
    )
    reqs = {"plain": (loop, greedy), "pen": (loop, penalised), "json": ([9, 10], guided)}
    spec = LLMEngine.from_model_dir(model, EngineConfig(num_blocks=64, num_speculative_tokens=3))
    got = _run(spec, reqs)
    base = _run(LLMEngine.from_model_dir(model, EngineConfig(num_blocks=64)), reqs)
    assert spec.num_draft_tokens > 0  # drafting happened (for the plain request)
    for rid in ("plain", "pen"):
        assert got[rid].outputs[0].token_ids == base[rid].outputs[0].token_ids, rid
    assert got["json"].outputs[0].finish_reason == "stop"
    assert json.loads(got["json"].outputs[0].text)["k"] in ("x", "y")
