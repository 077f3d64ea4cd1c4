"""``pagedkv serve`` on a checkpoint as users ship it: a folder written by transformers'
``save_pretrained`` (template in ``chat_template.jinja``) with a ``generation_config.json``.
A real child process, real HTTP."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from transformers import PreTrainedTokenizerFast

from e2e.server_fixtures import spawned_server, write_endless_model

pytestmark = pytest.mark.engine

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    folder = tmp_path_factory.mktemp("srv-ckpt")
    model = write_endless_model(folder / "m")
    (model / "tokenizer_config.json").unlink()
    hf = PreTrainedTokenizerFast(tokenizer_file=str(model / "tokenizer.json"), bos_token="<s>")
    hf.chat_template = TEMPLATE
    hf.save_pretrained(str(model))  # writes chat_template.jinja, not tokenizer_config's entry
    gen = {"temperature": 0.0, "max_new_tokens": 3}
    (model / "generation_config.json").write_text(json.dumps(gen))
    log = folder / "serve.log"
    extra = ["--served-model-name", "shipped", "--threads", "1"]
    with spawned_server(model, log, extra) as (base, _):
        yield base, log


def test_chat_works_on_a_save_pretrained_folder(served: tuple[str, Path]) -> None:
    base, log = served
    assert httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"] == "shipped"
    body = {"model": "shipped", "messages": [{"role": "user", "content": "hello there"}]}
    replies = [httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60) for _ in range(2)]
    assert [r.status_code for r in replies] == [200, 200]
    first, second = (r.json() for r in replies)
    # generation_config.json's defaults: max_new_tokens 3 (the model never ends), greedy
    assert first["usage"]["completion_tokens"] == 3
    assert first["choices"][0]["message"] == second["choices"][0]["message"]
    startup = [line for line in log.read_text().splitlines() if line.startswith("pagedkv: model")]
    assert len(startup) == 1
    assert "chat template chat_template.jinja" in startup[0]
    assert "served as 'shipped'" in startup[0]


def test_a_value_the_request_gives_wins_over_the_default(served: tuple[str, Path]) -> None:
    base, _ = served
    body = {"model": "shipped", "prompt": "hello", "max_tokens": 5}
    reply = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200
    assert reply.json()["usage"]["completion_tokens"] == 5
