"""The OpenAI-compatible API over real HTTP with the official ``openai`` client: completions and
chat, streaming and not, give the same tokens as offline ``LLM.generate`` for the same seed;
``n``, ``stop``, ``stream_options.include_usage`` and ``prompt_tokens_details.cached_tokens``
behave as OpenAI documents; /v1/models, /health and /metrics answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from e2e.server_fixtures import MODEL_NAME, ServerHandle, get, running_server, write_endless_model
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampler import SamplingParams

pytestmark = pytest.mark.engine

# 70+ tokens: several full 16-token blocks to share
LONG_PROMPT = " ".join(
    [
        "You are a helpful assistant. Answer briefly and clearly.",
        "Paged attention stores keys and values in fixed-size blocks.",
        "Prefix caching lets requests that share a system prompt reuse its blocks.",
    ]
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_endless_model(tmp_path_factory.mktemp("srv-api") / "m")


@pytest.fixture(scope="module")
def srv(model_dir: Path) -> Iterator[ServerHandle]:
    with running_server(model_dir) as handle:
        yield handle


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(str(model_dir))


@pytest.fixture
def client(srv: ServerHandle) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=30) as c:
        yield c
    srv.wait_idle()  # every test leaves no request and no block behind
    srv.check_invariants()


def _offline(llm: LLM, prompt: str | list[int], **kw: Any) -> list[str]:
    out = llm.generate(prompt, SamplingParams(**kw), progress=False)[0]
    return [c.text for c in out.outputs]


def _chat_ids(llm: LLM, messages: list[dict[str, str]]) -> list[int]:
    tok = llm.tokenizer
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    return list(tok.encode(text, add_special_tokens=False))


SAMPLINGS = [
    pytest.param({"temperature": 0.0}, id="greedy"),
    pytest.param({"temperature": 0.9, "top_p": 0.8, "seed": 1234}, id="seeded"),
]


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_completion_equals_offline_generate(
    client: openai.OpenAI, offline: LLM, sampling: dict[str, Any]
) -> None:
    prompt = "The quick brown fox"
    want = _offline(offline, prompt, max_tokens=12, **sampling)
    resp = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=12, **sampling)
    assert [c.text for c in resp.choices] == want
    assert resp.choices[0].finish_reason in ("length", "stop")
    assert resp.usage is not None
    assert resp.usage.prompt_tokens == len(offline.tokenizer.encode(prompt))
    assert 1 <= resp.usage.completion_tokens <= 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens

    stream = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=12, stream=True, **sampling
    )
    pieces = [ch.choices[0].text for ch in stream if ch.choices]
    assert "".join(pieces) == want[0]
    assert len(pieces) >= 2  # really streamed, not one final chunk


@pytest.mark.parametrize("sampling", SAMPLINGS)
def test_chat_equals_offline_generate_on_the_template(
    client: openai.OpenAI, offline: LLM, sampling: dict[str, Any]
) -> None:
    messages = [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    want = _offline(offline, _chat_ids(offline, messages), max_tokens=10, **sampling)
    resp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        **sampling,
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert [c.message.content for c in resp.choices] == want

    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=10,
        stream=True,
        **sampling,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want[0]
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert all(ch.usage is None for ch in chunks)  # no usage unless asked for


def test_n2_returns_two_choices_matching_offline(client: openai.OpenAI, offline: LLM) -> None:
    kw: dict[str, Any] = {"temperature": 1.0, "seed": 7, "n": 2}
    want = _offline(offline, LONG_PROMPT, max_tokens=8, **kw)
    resp = client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=8, **kw)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    got = [c.text for c in sorted(resp.choices, key=lambda c: c.index)]
    assert got == want
    assert got[0] != got[1]  # two samples from two generators, not one copied
    assert resp.usage is not None
    assert resp.usage.completion_tokens == 16

    stream = client.completions.create(
        model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=8, stream=True, **kw
    )
    texts = ["", ""]
    finished = [0, 0]
    for ch in stream:
        for c in ch.choices:
            texts[c.index] += c.text
            finished[c.index] += c.finish_reason is not None
    assert texts == want
    assert finished == [1, 1]  # each choice reports its finish reason exactly once


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI, offline: LLM) -> None:
    prompt = "Paged attention stores keys"
    full = _offline(offline, prompt, max_tokens=24, temperature=0.0)[0]
    stop = full[6:8]  # something the model really generates, not at the start
    assert stop
    assert stop not in full[:6]
    want = _offline(offline, prompt, max_tokens=24, temperature=0.0, stop=(stop,))
    assert want[0] == full[: full.index(stop)]
    resp = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "\x00never"]
    )
    assert resp.choices[0].text == want[0]
    assert resp.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True
    )
    chunks = [ch for ch in stream if ch.choices]
    assert "".join(ch.choices[0].text for ch in chunks) == want[0]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_include_usage_sends_a_final_usage_chunk(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "hello there!"}],
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert chunks[-2].choices[0].finish_reason == "length"
    assert last.usage.completion_tokens == 6
    assert last.usage.prompt_tokens > 0
    assert all(ch.usage is None for ch in chunks[:-1])


def test_cached_tokens_reported_on_a_repeated_prompt(
    client: openai.OpenAI, srv: ServerHandle
) -> None:
    prompt = "A fresh start no earlier test sent. " + LONG_PROMPT
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage is not None
    assert second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None
    block = srv.engine.engine.config.block_size
    # every full block of the prompt but the last token's (which is recomputed for its logits)
    assert cached == (second.usage.prompt_tokens - 1) // block * block
    assert cached >= 4 * block
    assert second.choices[0].text == first.choices[0].text


def test_models_health_and_metrics(client: openai.OpenAI, srv: ServerHandle) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].object == "model"
    max_len = srv.engine.engine.max_model_len
    assert models.data[0].model_extra == {"max_model_len": max_len}  # vLLM's extra field
    one = get(srv, f"/v1/models/{MODEL_NAME}").json()
    assert one == models.data[0].model_dump(exclude_none=True)
    assert get(srv, "/health").status_code == 200

    client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=5, temperature=0)
    client.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=5, temperature=0)
    resp = get(srv, "/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    values = _parse_prometheus(resp.text)
    assert values["pagedkv_prefix_cache_queries_tokens_total"] > 0
    assert values["pagedkv_prefix_cache_hits_tokens_total"] > 0
    assert (
        values["pagedkv_prefix_cache_hits_tokens_total"]
        <= values["pagedkv_prefix_cache_queries_tokens_total"]
    )
    assert values["pagedkv_requests_running"] == 0
    assert values["pagedkv_requests_waiting"] == 0
    assert values["pagedkv_kv_cache_usage_ratio"] == 0.0  # nothing in flight
    assert values["pagedkv_kv_cached_blocks"] > 0
    assert values["pagedkv_kv_free_blocks"] > 0
    assert values["pagedkv_time_to_first_token_seconds_count"] >= 2
    assert values["pagedkv_inter_token_latency_seconds_count"] >= 8  # 4 gaps x 2 requests
    assert "pagedkv_preemptions_total" in values


def _parse_prometheus(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition (labelled ones keep their labels)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        values[name] = float(value)
    return values
