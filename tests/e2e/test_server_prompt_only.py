"""Completions with ``echo: true, max_tokens: 0`` (how lm-evaluation-harness scores a prompt,
as vLLM serves it): the prompt's text and logprobs only, streamed or not, one prompt or a batch,
through the official ``openai`` client; ``max_tokens: 0`` without echo is a 400."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from e2e.server_fixtures import MODEL_NAME, openai_client
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.engine

TEXT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("srv-prompt-only") / "m")


@pytest.fixture(scope="module")
def client(model: Path) -> Iterator[openai.OpenAI]:
    with openai_client(model, EngineConfig(max_model_len=256, check_invariants=True)) as c:
        yield c


def _score(client: openai.OpenAI, prompt: Any, max_tokens: int, **kw: Any) -> Any:
    return client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1,
        temperature=0, **kw,
    )  # fmt: skip


def test_the_prompt_and_its_logprobs_only(model: Path, client: openai.OpenAI) -> None:
    n = len(Tokenizer(model).encode(TEXT))
    resp = _score(client, TEXT, 0)
    (choice,) = resp.choices
    assert choice.text == TEXT
    assert choice.finish_reason == "length"
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == n
    assert lp.token_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:])
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (n, 0)
    one = _score(client, TEXT, 1).choices[0]  # the same prompt part, then a generated token
    assert one.logprobs.token_logprobs[:n] == lp.token_logprobs
    assert len(one.logprobs.tokens) == n + 1


def test_streamed_and_batched(client: openai.OpenAI) -> None:
    want = _score(client, TEXT, 0).choices[0]
    events = list(_score(client, TEXT, 0, stream=True))
    assert "".join(e.choices[0].text for e in events) == TEXT
    streamed = [x for e in events if e.choices[0].logprobs for x in e.choices[0].logprobs.tokens]
    assert streamed == want.logprobs.tokens
    assert events[-1].choices[0].finish_reason == "length"
    batch = _score(client, [TEXT, TEXT + " again"], 0)
    assert [c.text for c in sorted(batch.choices, key=lambda c: c.index)] == [
        TEXT,
        TEXT + " again",
    ]
    assert batch.usage.completion_tokens == 0


def test_zero_tokens_without_echo_is_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL_NAME, prompt=TEXT, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=0
        )


def test_top_logprobs_always_hold_the_chosen_token(client: openai.OpenAI) -> None:
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be
    up to logprobs+1 elements"; ``logprobs: 0`` is the chosen token alone (lm-evaluation-harness
    reads the most likely key of each position)."""
    for k, temperature in ((0, 0.0), (1, 1.5), (2, 1.5)):
        lp = client.completions.create(
            model=MODEL_NAME, prompt=TEXT, max_tokens=12, logprobs=k, temperature=temperature,
            seed=5, echo=True,
        ).choices[0].logprobs  # fmt: skip
        rows = zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True)
        for tok, val, top in rows:
            assert tok in top  # its value may be another id's of the same text ("\ufffd")
            assert len(top) <= k + 1
            if k == 0:
                assert top == {tok: val}
