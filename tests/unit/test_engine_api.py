"""Sampler, tokenizer, LLMEngine errors and streaming, LLM and the CLI on the tiny local model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pagedkv.engine import native
from pagedkv.engine.cli import demo_main, generate_main
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm import LLM
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams, make_generator, sample
from pagedkv.engine.spec_decode import NgramProposer, accept_drafts
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pagedkv.errors import (
    InvalidRequestError,
    ModelLoadError,
    PromptTooLongError,
    UnknownRequestError,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


def _engine(model_dir: Path, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"block_size": 4, "num_blocks": 256, "max_model_len": 128, **kw})
    return LLMEngine.from_model_dir(str(model_dir), cfg)


def _drain(engine: LLMEngine) -> dict[str, Any]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


# ---------------------------------------------------------------- sampler
@pytest.mark.parametrize(
    "kw",
    [
        {"max_tokens": 0},
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -2},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"n": 0},
        {"seed": -3},
        {"stop": ("",)},
    ],
)
def test_invalid_sampling_values_raise(kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)


def test_top_k_minus_one_is_off_as_in_vllm() -> None:
    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    assert SamplingParams(top_k=-1).top_k == 0


def test_top_k_top_p_and_seeds() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0]])
    drawn = {
        sample(logits, SamplingParams(top_k=2), make_generator(s, torch.device("cpu")))[0]
        for s in range(60)
    }
    assert drawn == {3, 4}
    probs = torch.softmax(logits[0], 0)  # p(4)=.64, p(3)=.24: top_p .7 keeps exactly {4, 3}
    assert probs[4] < 0.7 < probs[4] + probs[3]
    drawn = {
        sample(logits, SamplingParams(top_p=0.7), make_generator(s, torch.device("cpu")))[0]
        for s in range(60)
    }
    assert drawn == {3, 4}
    assert sample(logits, SamplingParams(temperature=0.0), None) == [4]
    a = [sample(logits, SamplingParams(), make_generator(5, torch.device("cpu"))) for _ in "ab"]
    assert a[0] == a[1]


def test_ngram_proposer_and_acceptance() -> None:
    prop = NgramProposer(num_draft_tokens=3)
    assert prop.propose([1, 2, 3, 4, 9, 1, 2, 3]) == [4, 9, 1]
    assert prop.propose([5, 6, 7]) == []
    assert prop.propose([1, 2, 1, 2], limit=1) == [1]
    assert accept_drafts([4, 9, 1], [4, 9, 1, 7]) == [4, 9, 1, 7]
    assert accept_drafts([4, 9, 1], [4, 8, 1, 7]) == [4, 8]
    assert accept_drafts([4, 9, 1], [4, 8]) == [4, 8]  # a sampler that stopped at the rejection
    with pytest.raises(InvalidRequestError):
        accept_drafts([4], [4])
    with pytest.raises(InvalidRequestError):
        accept_drafts([4, 9], [4, 9])  # stopped without a rejection


# ---------------------------------------------------------------- tokenizer
def test_tokenizer_chat_template_and_streaming(model_dir: Path) -> None:
    tok = Tokenizer(model_dir)
    text = "Paged attention, ünïcode ✓ and emoji 🙂"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = IncrementalDetokenizer(tok, tok.encode("prefix: "))
    deltas = [detok.add([t]) for t in ids]
    assert "".join(deltas) == text
    assert "\ufffd" not in "".join(deltas)  # multi-byte characters are held back until whole
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<s><|user|>hi<|end|><|assistant|>"


def test_chat_template_is_sandboxed(tmp_path: Path) -> None:
    path = write_tiny_model(tmp_path / "evil")
    cfg = path / "tokenizer_config.json"
    cfg.write_text('{"chat_template": "{{ messages.__class__.__mro__[1].__subclasses__() }}"}')
    with pytest.raises(InvalidRequestError, match="chat template failed"):
        Tokenizer(path).apply_chat_template([{"role": "user", "content": "x"}])
    (path / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json"):
        Tokenizer(path)


# ---------------------------------------------------------------- engine
def test_bad_requests_raise_and_the_engine_keeps_serving(model_dir: Path) -> None:
    engine = _engine(model_dir)
    engine.add_request("good", "The quick brown fox", SamplingParams(max_tokens=5))
    engine.step()
    with pytest.raises(PromptTooLongError, match="max_model_len is 128"):
        engine.add_request("long", list(range(128)))
    with pytest.raises(InvalidRequestError, match="empty prompt"):
        engine.add_request("empty", [])
    with pytest.raises(InvalidRequestError, match="outside"):
        engine.add_request("oov", [1, 2, 10_000])
    with pytest.raises(InvalidRequestError, match="already exists"):
        engine.add_request("good", "again")
    with pytest.raises(UnknownRequestError):
        engine.abort("never")
    done = _drain(engine)
    assert list(done) == ["good"]
    assert len(done["good"].outputs[0].token_ids) >= 1
    engine.check_invariants()


def test_abort_frees_blocks_and_other_requests_finish(model_dir: Path) -> None:
    engine = _engine(model_dir)
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2)
    engine.add_request("a", "hello there", p)
    engine.add_request("b", "what is the capital", p)
    engine.step()
    engine.step()
    engine.abort("a")
    done = _drain(engine)
    assert list(done) == ["b"]
    assert [len(c.token_ids) for c in done["b"].outputs] == [8, 8]
    assert engine.scheduler.manager.pool.num_used_blocks == 0
    engine.check_invariants()


def test_stop_strings_cut_text_and_stream_deltas_add_up(model_dir: Path) -> None:
    engine = _engine(model_dir)
    free = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    engine.add_request("free", "The quick brown fox", free)
    full = _drain(engine)["free"].outputs[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    assert stop
    engine.add_request(
        "cut", "The quick brown fox", SamplingParams(**{**_kw(free), "stop": (stop,)})
    )
    streamed = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.outputs[0].delta_text
            last = out
    assert last.outputs[0].finish_reason == "stop"
    assert last.outputs[0].text == full[: full.index(stop)]
    assert streamed == last.outputs[0].text


def _kw(p: SamplingParams) -> dict[str, Any]:
    return {f: getattr(p, f) for f in p.__slots__}


def test_seeded_sampling_is_independent_of_batching(model_dir: Path) -> None:
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=11)
    alone = _engine(model_dir)
    alone.add_request("x", "hello there", p)
    a = _drain(alone)["x"].outputs[0].token_ids
    busy = _engine(model_dir)
    busy.add_request("other", "The quick brown fox", SamplingParams(max_tokens=8, seed=1))
    busy.add_request("x", "hello there", p)
    assert _drain(busy)["x"].outputs[0].token_ids == a


def test_elastic_pool_grows_the_kv_tensors(model_dir: Path) -> None:
    engine = _engine(model_dir, num_blocks=256, initial_blocks=8)
    start = engine.runner.kv_cache.num_blocks
    engine.add_request(
        "a", "The quick brown fox " * 4, SamplingParams(max_tokens=20, temperature=0)
    )
    _drain(engine)
    assert engine.runner.kv_cache.num_blocks > start
    assert engine.runner.kv_cache.num_grows >= 1
    assert engine.runner.kv_cache.num_blocks <= 256  # never past the pool's capacity


def test_llm_generate_and_cli(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    llm = LLM(str(model_dir), block_size=8, num_blocks=128)
    outs = llm.generate(["hello", "The quick"], SamplingParams(max_tokens=4, temperature=0.0))
    assert [o.prompt_token_ids for o in outs] == [
        tuple(llm.tokenizer.encode(p)) for p in ["hello", "The quick"]
    ]
    assert all(1 <= len(o.outputs[0].token_ids) <= 4 for o in outs)
    with pytest.raises(InvalidRequestError, match="unknown engine option"):
        LLM(str(model_dir), no_such_option=1)
    rc = generate_main(["--model", str(model_dir), "--prompt", "hi", "--max-tokens", "3"])
    assert rc == 0
    chat = ["--model", str(model_dir), "--prompt", "hi", "--chat", "--n", "2", "--max-tokens", "3"]
    assert generate_main(chat) == 0
    assert "tokens/s" in capsys.readouterr().err
    assert generate_main(["--model", str(model_dir / "nope"), "--prompt", "hi"]) == 1
    one = ["--model", str(model_dir), "--prompt", "hi", "--max-tokens", "3"]
    with pytest.raises(SystemExit):
        generate_main([*one, "--decode-kernel", "fast"])
    capsys.readouterr()
    if not native.available():  # forcing the kernel without a compiler is a clear error
        assert generate_main([*one, "--decode-kernel", "native"]) == 1
        return
    outs_by_kernel = []
    for kernel in ("torch", "native"):
        assert generate_main([*one, "--decode-kernel", kernel, "--n", "2"]) == 0
        lines = capsys.readouterr().out.splitlines()
        outs_by_kernel.append([line for line in lines if line.startswith("[")])
    assert len(outs_by_kernel[0]) == 2
    assert outs_by_kernel[0] == outs_by_kernel[1]  # greedy: the same samples either way


def test_demo_runs_and_outputs_match(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo_main(["--tiny", "--turns", "2", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "outputs identical" in out
    assert "hit rate" in out


def test_seeded_samples_differ_from_each_other_and_repeat_across_runs(model_dir: Path) -> None:
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=3)
    runs = []
    for _ in range(2):
        engine = _engine(model_dir)
        engine.add_request("s", "The quick brown fox", p)
        runs.append([c.token_ids for c in _drain(engine)["s"].outputs])
        engine.check_invariants()
    assert runs[0] == runs[1]
    assert len(set(runs[0])) == 3


def test_a_failing_step_finishes_its_requests_with_error_and_serving_goes_on(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _engine(model_dir)
    engine.add_request("doomed", "hello there", SamplingParams(max_tokens=5, n=2))
    real = engine.runner.execute

    def boom(batch: Any) -> Any:
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine.runner, "execute", boom)
    outs = engine.step()
    assert [o.request_id for o in outs] == ["doomed"]
    assert outs[0].finished
    assert [c.finish_reason for c in outs[0].outputs] == ["error", "error"]
    assert engine.scheduler.manager.pool.num_used_blocks == 0
    monkeypatch.setattr(engine.runner, "execute", real)
    engine.add_request("next", "hello there", SamplingParams(max_tokens=3, temperature=0.0))
    done = _drain(engine)
    assert len(done["next"].outputs[0].token_ids) >= 1
    engine.check_invariants()


def test_bfloat16_on_cpu_and_generation_config_eos(model_dir: Path, tmp_path: Path) -> None:
    engine = _engine(model_dir, dtype="bfloat16")
    assert engine.runner.kv_cache.k[0].dtype is torch.bfloat16
    engine.add_request("b", "hello there", SamplingParams(max_tokens=4, temperature=0.0))
    assert 1 <= len(_drain(engine)["b"].outputs[0].token_ids) <= 4
    import shutil

    copy = Path(shutil.copytree(model_dir, tmp_path / "copy"))
    (copy / "generation_config.json").write_text('{"eos_token_id": [1, 7, 9]}')
    assert _engine(copy).eos_token_ids == (1, 7, 9)


def test_streamed_deltas_never_include_a_later_cut_stop_string(model_dir: Path) -> None:
    """Every split point: a stop string whose first characters arrive one token before the rest
    must not leak into the stream (the deltas always add up to the final, cut text)."""
    engine = _engine(model_dir)
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    engine.add_request("free", "Paged attention stores keys", free)
    full = _drain(engine)["free"].outputs[0].text
    for k in range(0, max(1, len(full) - 3), max(1, len(full) // 12)):
        stop = full[k : k + 3]
        if not stop.strip():
            continue
        rid = f"cut{k}"
        engine.add_request(
            rid, "Paged attention stores keys", SamplingParams(**{**_kw(free), "stop": (stop,)})
        )
        streamed = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                streamed += out.outputs[0].delta_text
                last = out
        assert last.outputs[0].text == full[: full.index(stop)]
        assert streamed == last.outputs[0].text, (k, stop)


def test_stop_prefix_len_finds_the_longest_pending_stop_prefix() -> None:
    from pagedkv.engine.llm_engine import _stop_prefix_len

    assert _stop_prefix_len("hello wo", ("world",)) == 2
    assert _stop_prefix_len("hello w", ("world", "xyz")) == 1
    assert _stop_prefix_len("hello", ("world",)) == 0
    assert _stop_prefix_len("ab", ("abc", "b")) == 2
    assert _stop_prefix_len("", ("abc",)) == 0


def test_a_request_that_outgrows_the_pool_alone_finishes_with_length(model_dir: Path) -> None:
    """The scheduler stops a lone request that cannot grow (finished inside schedule()); the
    engine must report it finished instead of waiting for it forever."""
    engine = _engine(model_dir, num_blocks=6, max_model_len=4096, reservation="none")
    engine.add_request(
        "big", [5, 6, 7], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    )
    done = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert not engine.has_unfinished_requests()
    assert done["big"].outputs[0].finish_reason == "length"
    assert engine.scheduler.manager.pool.num_used_blocks == 0


def test_a_request_id_can_be_reused_once_its_request_finished(model_dir: Path) -> None:
    engine = _engine(model_dir)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("a", [5, 6, 7], params)
    first = _drain(engine)["a"]
    engine.add_request("a", [5, 6, 7], params)
    engine.add_request("b", [9, 10, 11], params)
    done = _drain(engine)
    assert done["a"].outputs[0].token_ids == first.outputs[0].token_ids
    assert len(done["a"].outputs[0].token_ids) == 3
    assert len(done["b"].outputs[0].token_ids) == 3
