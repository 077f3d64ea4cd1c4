"""Every bad request gets its status and an OpenAI-style error body, and changes nothing: 400 for
invalid JSON, missing or bad fields, an unknown model, a prompt too long, bad sampling values and
unsupported fields; 401 for a missing or wrong API key on every route but /health; 404 for an
unknown route.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from e2e.server_fixtures import MODEL_NAME, ServerHandle, get, running_server, write_endless_model
from pagedkv.engine.engine_config import EngineConfig

pytestmark = pytest.mark.engine

KEY = "sk-test-0123456789"
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    model = write_endless_model(tmp_path_factory.mktemp("srv-err") / "m")
    cfg = EngineConfig(max_model_len=MAX_MODEL_LEN, check_invariants=True)
    with running_server(model, config=cfg, api_key=KEY) as handle:
        yield handle


@pytest.fixture
def http(srv: ServerHandle) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=srv.v1, headers=headers, timeout=30) as client:
        yield client
    srv.wait_idle()  # a rejected request holds nothing
    srv.check_invariants()


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err: dict[str, Any] = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str)
    assert err["message"]
    return err


CMPL = {"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
JSON = {"Content-Type": "application/json"}
TOO_LONG_IDS = list(range(2, 2 + MAX_MODEL_LEN))


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    body = {**base, **changes}
    return {k: v for k, v in body.items() if v is not ...}  # ``...`` drops a field


BAD_BODIES = [
    ("completions", _with(CMPL, model=...), "model"),
    ("completions", _with(CMPL, prompt=...), "prompt"),
    ("completions", _with(CMPL, prompt=[]), "prompt"),
    ("completions", _with(CMPL, prompt=[[]]), "prompt"),
    ("completions", _with(CMPL, prompt=["a"] * 129), "prompt"),  # over MAX_PROMPTS
    ("completions", _with(CMPL, prompt=[[1], []]), "prompt"),
    ("completions", _with(CMPL, prompt=[1, 10**6]), "outside"),
    ("completions", _with(CMPL, prompt=TOO_LONG_IDS), "max_model_len"),
    ("completions", _with(CMPL, prompt="the quick brown fox " * 20), "max_model_len"),
    ("completions", _with(CMPL, temperature=-0.1), "temperature"),
    ("completions", _with(CMPL, temperature=2.5), "temperature"),
    ("completions", _with(CMPL, top_p=0), "top_p"),
    ("completions", _with(CMPL, top_p=1.5), "top_p"),
    ("completions", _with(CMPL, n=0), "n"),
    ("completions", _with(CMPL, n=129), "n"),
    ("completions", _with(CMPL, seed=2**64), "seed"),
    ("completions", _with(CMPL, seed=2**63), "seed"),
    ("completions", _with(CMPL, best_of=2), "best_of"),
    ("completions", _with(CMPL, response_format={"type": "json_object", "x": 1}), "response_"),
    ("completions", _with(CMPL, service_tier="flex"), "service_tier"),
    ("completions", _with(CMPL, prompt="a \ud800 lone surrogate"), "surrogate"),
    ("completions", _with(CMPL, max_tokens=0), "max_tokens"),
    ("completions", _with(CMPL, max_tokens="ten"), "max_tokens"),
    ("completions", _with(CMPL, seed=-1), "seed"),
    ("completions", _with(CMPL, stop=["a", "b", "c", "d", "e"]), "stop"),
    ("completions", _with(CMPL, stop=[""]), "stop"),
    ("completions", _with(CMPL, logprobs=21), "logprobs"),
    ("completions", _with(CMPL, echo=True, logprobs=1, n=2), "prompt_logprobs"),
    ("completions", _with(CMPL, presence_penalty=2.5), "presence_penalty"),
    ("completions", _with(CMPL, logit_bias={"x": 1}), "logit_bias"),
    ("completions", _with(CMPL, logit_bias={"999999": 1}), "logit_bias"),
    ("completions", _with(CMPL, min_tokens=20, max_tokens=10), "min_tokens"),
    ("completions", _with(CMPL, guided_regex="a(b"), "regex"),
    ("completions", _with(CMPL, guided_json={"type": "object", "if": {}}), "if"),
    ("completions", _with(CMPL, guided_regex="a", guided_choice=["a"]), "guided_choice"),
    ("completions", _with(CMPL, stream_options={"include_usage": "maybe"}), "include_usage"),
    ("chat/completions", _with(CHAT, messages=...), "messages"),
    ("chat/completions", _with(CHAT, messages=[]), "messages"),
    ("chat/completions", _with(CHAT, messages=[{"role": "wizard", "content": "x"}]), "role"),
    (
        "chat/completions",
        _with(CHAT, messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        "image_url",
    ),
    (
        "chat/completions",
        _with(CHAT, messages=[{"role": "user", "content": "the quick brown fox " * 20}]),
        "max_model_len",
    ),
    ("chat/completions", _with(CHAT, tools=[{"type": "function"}]), "tools"),
    ("chat/completions", _with(CHAT, top_logprobs=3), "top_logprobs"),
    ("chat/completions", _with(CHAT, modalities=["text", "audio"]), "modalities"),
    ("chat/completions", _with(CHAT, metadata={f"k{i}": "v" for i in range(17)}), "metadata"),
    ("chat/completions", _with(CHAT, metadata={"k": "v" * 513}), "metadata"),
    ("chat/completions", _with(CHAT, metadata={"k": 1}), "metadata"),
    ("chat/completions", _with(CHAT, tool_choice="required"), "tool_choice"),
    (
        "chat/completions",
        _with(CHAT, tools=[{"type": "function", "function": {"name": "f"}}]),
        "auto",  # tool_choice defaults to auto, which needs --enable-auto-tool-choice
    ),
    (
        "chat/completions",
        _with(
            CHAT,
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "x",
                    "schema": {
                        "type": "object",
                        "patternProperties": {"a": {}},
                        "if": {"type": "object"},
                    },
                },
            },
        ),
        "if",
    ),
    ("chat/completions", _with(CHAT, top_p=-1), "top_p"),
    (
        "chat/completions",
        _with(CHAT, messages=[{"role": "user", "content": "\udfff"}]),
        "surrogate",
    ),
    (
        "chat/completions",
        _with(CHAT, messages=[{"role": "user", "content": "hi", "audio": {"id": "a"}}]),
        "audio",
    ),
    ("chat/completions", _with(CHAT, max_completion_tokens=0), "max_completion_tokens"),
]


@pytest.mark.parametrize(
    ("route", "body", "mentions"), BAD_BODIES, ids=[f"{r}-{m}" for r, _, m in BAD_BODIES]
)
def test_bad_body_gets_400(
    http: httpx.Client, route: str, body: dict[str, Any], mentions: str
) -> None:
    for stream in (False, True):  # streaming requests fail before the first byte, alike
        content = json.dumps({**body, "stream": stream})  # ASCII: a lone surrogate as \\udXXX
        resp = http.post(f"/{route}", content=content, headers=JSON)
        err = _error(resp, 400)
        assert err["type"] == "invalid_request_error"
        assert mentions in err["message"]
        assert err["param"] is None or mentions in err["param"]  # the field, when one is to blame


@pytest.mark.parametrize(
    "content",
    [b'{"model": "tiny", "prompt": ', b"not json", b'["a list"]', b""],
    ids=["truncated", "garbage", "not-an-object", "empty"],
)
def test_invalid_json_gets_400(http: httpx.Client, content: bytes) -> None:
    resp = http.post("/completions", content=content, headers={"Content-Type": "application/json"})
    assert _error(resp, 400)["type"] == "invalid_request_error"


@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_unknown_model_gets_404_model_not_found(http: httpx.Client, route: str) -> None:
    body = _with(CMPL if route == "completions" else CHAT, model="gpt-4o")
    for stream in (False, True):
        err = _error(http.post(f"/{route}", json={**body, "stream": stream}), 404)
        assert (err["type"], err["code"], err["param"]) == (
            "invalid_request_error", "model_not_found", "model",
        )  # fmt: skip
        assert "gpt-4o" in err["message"]


def test_openai_client_raises_bad_request_with_the_message(srv: ServerHandle) -> None:
    with openai.OpenAI(base_url=srv.v1, api_key=KEY, max_retries=0, timeout=30) as client:
        with pytest.raises(openai.NotFoundError, match="does not exist") as info:
            client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)
        assert info.value.status_code == 404
        with pytest.raises(openai.BadRequestError, match="seed") as bad:
            client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2, seed=2**64)
        assert bad.value.status_code == 400
        ok = client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
        assert ok.usage is not None
        assert ok.usage.completion_tokens == 2


ROUTES = [
    ("GET", "/v1/models"),
    ("GET", "/metrics"),
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/nowhere"),
]


@pytest.mark.parametrize(("method", "path"), ROUTES)
@pytest.mark.parametrize(
    "auth", [None, "Bearer wrong-key", f"Bearer {KEY}x", KEY, f"Basic {KEY}", "Bearer"]
)
def test_missing_or_wrong_key_gets_401(
    srv: ServerHandle, method: str, path: str, auth: str | None
) -> None:
    headers = {} if auth is None else {"Authorization": auth}
    body = CHAT if "chat" in path else CMPL
    resp = httpx.request(
        method, f"{srv.base_url}{path}", headers=headers, json=body if method == "POST" else None
    )
    err = _error(resp, 401)
    assert err["type"] == "authentication_error"
    assert KEY not in resp.text  # the key never leaks into an error


def test_the_right_key_opens_every_route_and_health_needs_none(srv: ServerHandle) -> None:
    assert get(srv, "/health").status_code == 200
    assert get(srv, "/v1/models", token=KEY).json()["data"][0]["id"] == MODEL_NAME
    assert "pagedkv_requests_running" in get(srv, "/metrics", token=KEY).text
    err = _error(get(srv, "/v1/nowhere", token=KEY), 404)
    assert err["type"] == "not_found_error"
    with (
        openai.OpenAI(base_url=srv.v1, api_key="wrong", max_retries=0, timeout=30) as client,
        pytest.raises(openai.AuthenticationError),
    ):
        client.models.list()
    with openai.OpenAI(base_url=srv.v1, api_key=KEY, max_retries=0, timeout=30) as client:
        chat = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.usage is not None
        assert chat.usage.completion_tokens == 3
    srv.wait_idle()
