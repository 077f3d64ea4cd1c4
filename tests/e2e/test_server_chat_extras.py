"""vLLM's chat extras on a real uvicorn server through the official ``openai`` client:
``continue_final_message`` with ``add_generation_prompt: false`` continues the assistant's last
message (the prompt ``encode_chat`` builds), ``chat_template_kwargs`` reach the template, and
what cannot be honoured is a 400 that names it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from e2e.server_fixtures import MODEL_NAME, openai_client
from pagedkv.engine.chat_encoding import encode_chat
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.engine

CHAT: list[Any] = [
    {"role": "user", "content": "Count to five."},
    {"role": "assistant", "content": "One, two, "},
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("srv-chat-extras") / "m")


@pytest.fixture(scope="module")
def client(model: Path) -> Iterator[openai.OpenAI]:
    with openai_client(model, EngineConfig(max_model_len=256, check_invariants=True)) as c:
        yield c


def _chat(client: openai.OpenAI, **extra: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=3, temperature=0, extra_body=extra
    )


def test_continue_final_message_prompt(model: Path, client: openai.OpenAI) -> None:
    tok = Tokenizer(model)
    resp = _chat(client, add_generation_prompt=False, continue_final_message=True)
    want = encode_chat(tok, CHAT, add_generation_prompt=False, continue_final_message=True)
    assert resp.usage.prompt_tokens == len(want)
    assert resp.usage.prompt_tokens < _chat(client).usage.prompt_tokens  # no new turn opened


def test_chat_template_kwargs_are_passed(client: openai.OpenAI) -> None:
    resp = _chat(client, chat_template_kwargs={"enable_thinking": False})  # unused: no effect
    assert resp.usage.prompt_tokens == _chat(client).usage.prompt_tokens


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"continue_final_message": True}, "cannot both be true"),
        ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
        ({"chat_template_kwargs": {"x": "<|end|>"}}, "special token"),
        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ],
)
def test_refusals_name_the_field(client: openai.OpenAI, extra: dict[str, Any], match: str) -> None:
    with pytest.raises(openai.BadRequestError, match=match):
        _chat(client, **extra)
