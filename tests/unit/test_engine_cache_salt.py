"""``cache_salt`` through the engine and ``LLM``: a salted request hits only blocks computed
under its salt, its blocks carry the hashes the router computes for that salt, outputs never
change, and ``LLM.generate`` takes vLLM's prompt dicts and queues all prompts or none."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm import LLM
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.errors import InvalidRequestError
from pagedkv.router.engines import HashSpec

PROMPT = list(range(3, 40))  # 9 full blocks of 4 and a tail
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("salt") / "m")


def _engine(model_dir: Path) -> LLMEngine:
    cfg = EngineConfig(block_size=4, num_blocks=256, max_model_len=128, check_invariants=True)
    return LLMEngine.from_model_dir(str(model_dir), cfg)


def _run(engine: LLMEngine, rid: str, salt: str | None, n: int = 1) -> Any:
    params = SamplingParams(max_tokens=6, temperature=0.0, n=n)
    engine.add_request(rid, PROMPT, params, cache_salt=salt)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done[rid]


def test_salts_isolate_hits_and_never_change_outputs(model_dir: Path) -> None:
    engine = _engine(model_dir)
    first = _run(engine, "a1", "tenant-a")
    assert first.num_cached_tokens == 0
    again = _run(engine, "a2", "tenant-a")
    assert again.num_cached_tokens == 36  # every full block of the prompt
    assert _run(engine, "b1", "tenant-b").num_cached_tokens == 0
    assert _run(engine, "plain", None).num_cached_tokens == 0  # no salt is not a salt
    assert _run(engine, "b2", "tenant-b").num_cached_tokens == 36
    tokens = {_run(engine, f"x{i}", s).outputs[0].token_ids for i, s in enumerate("ab")}
    assert tokens == {first.outputs[0].token_ids} == {again.outputs[0].token_ids}
    engine.scheduler.check_invariants()


def test_salted_blocks_carry_the_routers_hashes(model_dir: Path) -> None:
    engine = _engine(model_dir)
    _run(engine, "a", "tenant-a")
    cfg = engine.scheduler.manager.config
    spec = HashSpec(cfg.block_size, cfg.model_id, cfg.hash_algo.value)
    pool = engine.scheduler.manager.pool
    salted = spec.hashes(PROMPT, "tenant-a")
    assert len(salted) == 9
    assert all(pool.is_cached(h) for h in salted)
    assert not any(pool.is_cached(h) for h in spec.hashes(PROMPT, "tenant-b"))
    assert not any(pool.is_cached(h) for h in spec.hashes(PROMPT))


def test_forked_samples_share_the_salt(model_dir: Path) -> None:
    engine = _engine(model_dir)
    _run(engine, "a", "tenant-a", n=3)
    assert _run(engine, "a2", "tenant-a").num_cached_tokens == 36
    assert _run(engine, "b", "tenant-b").num_cached_tokens == 0


@pytest.mark.parametrize("salt", ["", 7, b"x"])
def test_a_bad_salt_is_refused_and_changes_nothing(model_dir: Path, salt: Any) -> None:
    engine = _engine(model_dir)
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        engine.add_request("r", PROMPT, GREEDY, cache_salt=salt)
    assert not engine.has_unfinished_requests()
    engine.add_request("r", PROMPT, GREEDY)  # the id is still free


def test_llm_takes_vllm_prompt_dicts(model_dir: Path) -> None:
    llm = LLM(str(model_dir), block_size=4, num_blocks=256, max_model_len=128)
    ids_out, salted, text_out = llm.generate(
        [
            {"prompt_token_ids": PROMPT},
            {"prompt_token_ids": PROMPT, "cache_salt": "t"},
            {"prompt": "hello world"},
        ],
        GREEDY,
        progress=False,
    )
    assert ids_out.outputs[0].token_ids == salted.outputs[0].token_ids
    assert salted.num_cached_tokens == 0  # the unsalted copy's blocks do not serve salt "t"
    assert list(text_out.prompt_token_ids) == llm.tokenizer.encode("hello world")
    (one,) = llm.generate({"prompt_token_ids": PROMPT, "cache_salt": "t"}, GREEDY, progress=False)
    assert one.num_cached_tokens == 36


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ({"prompt": "hi", "multi_modal_data": {}}, "multi_modal_data"),
        ({"cache_salt": "t"}, "prompt_token_ids"),
        ({"prompt_token_ids": "abc"}, "list of token ids"),
        ({"prompt": "hi", "cache_salt": ""}, "cache_salt"),
    ],
)
def test_llm_generate_queues_all_prompts_or_none(
    model_dir: Path, bad: dict[str, Any], match: str
) -> None:
    llm = LLM(str(model_dir), block_size=4, num_blocks=256, max_model_len=128)
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate([PROMPT, {"prompt_token_ids": PROMPT}, bad], GREEDY, progress=False)
    assert not llm.engine.has_unfinished_requests()  # the two good prompts were taken back
    assert llm.engine.scheduler.manager.pool.num_used_blocks == 0
    (out,) = llm.generate([PROMPT], GREEDY, progress=False)
    assert out.finished


def test_llm_takes_vllms_keyword_names_and_reports_the_prompt_text(model_dir: Path) -> None:
    llm = LLM(str(model_dir), block_size=4, num_blocks=256, max_model_len=128)
    (by_alias,) = llm.generate(["hello world"], sampling_params=GREEDY, use_tqdm=False)
    (plain,) = llm.generate(["hello world"], GREEDY, progress=False)
    assert by_alias.outputs[0].token_ids == plain.outputs[0].token_ids
    assert by_alias.prompt == "hello world"  # vLLM's RequestOutput.prompt
    (ids_only,) = llm.generate([PROMPT], sampling_params=GREEDY, use_tqdm=False)
    assert ids_only.prompt is None
    with pytest.raises(InvalidRequestError, match="not both"):
        llm.generate(["hi"], GREEDY, sampling_params=GREEDY, use_tqdm=False)
