"""``/v1/completions`` with several prompts, through the ``openai`` client on real uvicorn: one
choice per prompt and sample (index = prompt_i * n + sample_j), each equal to that prompt sent
alone, usage summed; streamed events add up to the whole; one refused prompt refuses all."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from e2e.server_fixtures import MODEL_NAME, ServerHandle, running_server, write_endless_model

pytestmark = pytest.mark.engine

PROMPTS = ["The quick brown fox", "hello", "a b c d e f"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    with running_server(write_endless_model(tmp_path_factory.mktemp("batch") / "m")) as h:
        yield h


@pytest.fixture
def client(srv: ServerHandle) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    srv.wait_idle()
    srv.check_invariants()


def _alone(client: openai.OpenAI, prompt: str | list[int], n: int) -> openai.types.Completion:
    return client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=6, n=n, seed=5, temperature=0.0
    )


@pytest.mark.parametrize("as_ids", [False, True])
def test_each_prompt_gets_n_choices_numbered_prompt_times_n_plus_sample(
    client: openai.OpenAI, srv: ServerHandle, as_ids: bool
) -> None:
    tok = srv.engine.engine.tokenizer
    assert tok is not None
    prompts: list[str] | list[list[int]] = [tok.encode(p) for p in PROMPTS] if as_ids else PROMPTS
    n = 2
    alone = [_alone(client, p, n) for p in prompts]
    batch = client.completions.create(
        model=MODEL_NAME, prompt=prompts, max_tokens=6, n=n, seed=5, temperature=0.0
    )
    assert [c.index for c in batch.choices] == list(range(len(PROMPTS) * n))
    for c in batch.choices:
        i, j = divmod(c.index, n)
        assert c.text == alone[i].choices[j].text
        assert c.finish_reason == "length"
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone if a.usage)
    assert batch.usage.completion_tokens == len(PROMPTS) * n * 6
    assert batch.usage.total_tokens == batch.usage.prompt_tokens + batch.usage.completion_tokens


def test_streamed_batch_adds_up_to_the_whole_with_summed_usage(client: openai.OpenAI) -> None:
    kw = {"model": MODEL_NAME, "prompt": PROMPTS, "max_tokens": 8, "n": 2, "seed": 1}
    whole = client.completions.create(**kw, temperature=0.0, echo=True)  # type: ignore[call-overload]
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.completions.create(  # type: ignore[call-overload]
        **kw, temperature=0.0, echo=True, stream=True, stream_options={"include_usage": True}
    ):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert texts == {c.index: c.text for c in whole.choices}
    assert all(texts[k].startswith(PROMPTS[k // 2]) for k in texts)  # each echoes its prompt
    assert finish == {c.index: "length" for c in whole.choices}
    assert usage is not None
    assert whole.usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )


def test_one_prompt_too_long_refuses_the_batch_and_leaves_nothing_running(
    client: openai.OpenAI, srv: ServerHandle
) -> None:
    too_long = [5] * (srv.engine.engine.max_model_len + 1)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="max_model_len"):
            client.completions.create(
                model=MODEL_NAME, prompt=[[5, 6, 7], too_long], max_tokens=50, stream=stream
            )
        srv.wait_idle()  # the first prompt, already added, was aborted


def test_batches_over_the_limit_or_with_an_empty_prompt_are_refused(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="a batch of 129 prompts; at most 128"):
        client.completions.create(model=MODEL_NAME, prompt=["a"] * 129, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="empty list of token ids"):
        client.completions.create(model=MODEL_NAME, prompt=[[1], []], max_tokens=1)
