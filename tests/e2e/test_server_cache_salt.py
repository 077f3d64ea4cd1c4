"""vLLM's ``cache_salt`` request field on a real uvicorn server, sent by the official ``openai``
client's ``extra_body``: a salt hits only what was computed under it (``cached_tokens``), the
outputs never change, a list of prompts shares the salt, and an empty salt is a 400 naming it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from e2e.server_fixtures import MODEL_NAME, ServerHandle, running_server, write_endless_model
from pagedkv.engine.engine_config import EngineConfig

pytestmark = pytest.mark.engine

PROMPT = list(range(1, 40))  # two full blocks of 16 and a tail


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    model = write_endless_model(tmp_path_factory.mktemp("srv-salt") / "m")
    cfg = EngineConfig(max_model_len=256, check_invariants=True)
    with running_server(model, config=cfg) as handle:
        yield handle


@pytest.fixture(scope="module")
def client(srv: ServerHandle) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def _complete(client: openai.OpenAI, salt: str | None, prompt: Any = PROMPT) -> Any:
    extra = {} if salt is None else {"cache_salt": salt}
    return client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, extra_body=extra
    )


def _cached(resp: Any) -> int:
    return int(resp.usage.prompt_tokens_details.cached_tokens)


def test_a_salt_hits_only_its_own_blocks(srv: ServerHandle, client: openai.OpenAI) -> None:
    srv.engine.engine.reset_prefix_cache()
    first = _complete(client, "tenant-a")
    assert _cached(first) == 0
    assert _cached(_complete(client, "tenant-a")) == 32
    assert _cached(_complete(client, "tenant-b")) == 0
    assert _cached(_complete(client, None)) == 0
    other = _complete(client, "tenant-b")
    assert _cached(other) == 32
    assert other.choices[0].text == first.choices[0].text
    srv.check_invariants()


def test_a_batch_of_prompts_shares_the_salt(srv: ServerHandle, client: openai.OpenAI) -> None:
    srv.engine.engine.reset_prefix_cache()
    _complete(client, "tenant-c")
    batch = _complete(client, "tenant-c", prompt=[PROMPT, PROMPT])
    assert _cached(batch) == 64  # both prompts hit tenant-c's two blocks
    assert _cached(_complete(client, "tenant-d", prompt=[PROMPT])) == 0


def test_chat_takes_the_salt(srv: ServerHandle, client: openai.OpenAI) -> None:
    # the endless model has no chat template: the salt is read (and checked) before that 400
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"cache_salt": ""},
        )
    assert "cache_salt" in str(err.value)


@pytest.mark.parametrize("salt", ["", 3, ["a"]])
def test_a_bad_salt_is_a_400_naming_it(srv: ServerHandle, client: openai.OpenAI, salt: Any) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=2, extra_body={"cache_salt": salt}
        )
    assert "cache_salt" in str(err.value)
    srv.wait_idle()
    assert srv.num_used_blocks() == 0
