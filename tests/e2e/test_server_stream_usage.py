"""``stream_options`` through the official ``openai`` client: ``include_usage`` gives one last
usage event; with vLLM's ``continuous_usage_stats`` every event carries the usage so far
(completion tokens never fall, the last equals the final usage); OpenAI's
``include_obfuscation`` is accepted; an unknown option is a 400 naming it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from e2e.server_fixtures import MODEL_NAME, openai_client, write_endless_model
from pagedkv.engine.engine_config import EngineConfig

pytestmark = pytest.mark.engine

PROMPT = list(range(1, 20))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[openai.OpenAI]:
    model: Path = write_endless_model(tmp_path_factory.mktemp("srv-usage") / "m")
    with openai_client(model, EngineConfig(max_model_len=256)) as c:
        yield c


def _events(client: openai.OpenAI, prompt: Any, **opts: Any) -> list[Any]:
    return list(
        client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=6, temperature=0, stream=True,
            stream_options=opts,  # type: ignore[arg-type]
        )
    )  # fmt: skip


def test_include_usage_alone_gives_one_usage_event(client: openai.OpenAI) -> None:
    events = _events(client, PROMPT, include_usage=True)
    assert [e.usage is not None for e in events].count(True) == 1
    assert events[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("prompt", [PROMPT, [PROMPT, PROMPT[:7]]])
def test_continuous_usage_on_every_event(client: openai.OpenAI, prompt: Any) -> None:
    events = _events(client, prompt, include_usage=True, continuous_usage_stats=True)
    assert all(e.usage is not None for e in events)
    done = [e.usage.completion_tokens for e in events]
    assert done == sorted(done)
    assert done[-1] == 6 * (len(prompt) if isinstance(prompt[0], list) else 1)
    assert len(set(done)) > 1  # it moved: not only the last event's figure


def test_continuous_without_include_usage_adds_nothing(client: openai.OpenAI) -> None:
    events = _events(client, PROMPT, continuous_usage_stats=True)
    assert all(e.usage is None for e in events)


def test_obfuscation_accepted_and_unknown_refused(client: openai.OpenAI) -> None:
    assert _events(client, PROMPT, include_usage=True, include_obfuscation=False)
    with pytest.raises(openai.BadRequestError, match="usage_every_token"):
        _events(client, PROMPT, usage_every_token=True)
