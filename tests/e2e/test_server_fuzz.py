"""A bounded fuzz run over the request JSON of ``/v1/completions`` and ``/v1/chat/completions``
against a real server: never a 500, and every answer has its OpenAI shape.

Hypothesis draws bodies mixing valid values, wrong types, out-of-range numbers (NaN, inf, huge
ints), lone surrogates, unknown fields and nested junk, streamed or not. Every answer must be a
200 with a completion body (or an event stream ending in ``[DONE]`` with no internal error
event), or a 4xx with ``{"error": {"message", "type", "param", "code"}}``. Bounded to ~150
examples in all (about 20 s on the tiny model); the server's invariants hold afterwards.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e.server_fixtures import MODEL_NAME, ServerHandle, running_server, write_endless_model
from pagedkv.engine.engine_config import EngineConfig

pytestmark = pytest.mark.engine

FUZZ = settings(
    max_examples=75,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,  # the same examples every CI run
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["\ud800", "<|user|>", "<|end|>", "", "text", "auto"]),
)
junk = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


def mostly(valid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``valid`` seven times in eight, junk otherwise (so most bodies reach the engine)."""
    return st.integers(min_value=0, max_value=7).flatmap(lambda i: valid if i else junk)


small_ints = mostly(st.integers(min_value=-2, max_value=6))
unit_floats = mostly(
    st.floats(min_value=-0.5, max_value=2.5) | st.sampled_from([0, 1, 1e-46, 1e-38, 1e-5])
)
prompts = mostly(
    st.text(max_size=40) | st.lists(st.integers(min_value=-5, max_value=400), max_size=8)
)
content = mostly(
    st.text(max_size=30)
    | st.none()
    | st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]), "text": st.text(max_size=8)}
        ),
        max_size=2,
    )
)
messages = mostly(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["system", "user", "assistant", "tool", "tool", "wizard"])},
            optional={
                "content": content,
                "name": mostly(st.text(max_size=5)),
                "tool_call_id": mostly(st.text(max_size=5)),
                "tool_calls": mostly(st.lists(st.fixed_dictionaries({"id": st.text()}))),
            },
        ),
        min_size=1,
        max_size=3,
    )
)
common = {
    "max_tokens": small_ints,
    "temperature": unit_floats,
    "top_p": unit_floats,
    "top_k": small_ints,
    "seed": mostly(st.integers(min_value=-1, max_value=2**65)),
    "n": small_ints,
    "stop": mostly(st.text(max_size=3) | st.lists(st.text(max_size=3), max_size=5)),
    "stream": st.booleans(),
    "stream_options": mostly(st.fixed_dictionaries({"include_usage": st.booleans()})),
    "user": mostly(st.text(max_size=5)),
    "response_format": mostly(st.just({"type": "text"})),
    "best_of": mostly(st.just(1)),
    "service_tier": mostly(st.sampled_from(["auto", "default"])),
    "parallel_tool_calls": mostly(st.booleans()),
}
models = mostly(st.sampled_from([MODEL_NAME, MODEL_NAME, MODEL_NAME, "gpt-4o"]))


def _body(extra: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    return st.fixed_dictionaries({"model": models} | extra, optional=common)


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    model = write_endless_model(tmp_path_factory.mktemp("srv-fuzz") / "m")
    cfg = EngineConfig(max_model_len=64, num_blocks=128, block_size=4, check_invariants=True)
    with running_server(model, config=cfg) as handle:
        yield handle
        handle.wait_idle()
        handle.check_invariants()


@pytest.fixture(scope="module")
def http(srv: ServerHandle) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.v1, timeout=60) as client:
        yield client


def _check_answer(resp: httpx.Response, body: dict[str, Any]) -> None:
    assert resp.status_code < 500, (body, resp.text)
    if resp.status_code >= 400:
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, resp.text
        assert isinstance(err["message"], str)
        assert err["message"]
        return
    assert resp.status_code == 200, resp.text
    if resp.headers["content-type"].startswith("text/event-stream"):
        events = [line for line in resp.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]", resp.text
        assert '"internal_error"' not in resp.text, resp.text
    else:
        assert resp.json()["choices"], resp.text


def _post(http: httpx.Client, route: str, body: dict[str, Any]) -> httpx.Response:
    content = json.dumps(body)  # ASCII with \\u escapes; NaN/Infinity as Python writes them
    return http.post(route, content=content, headers={"Content-Type": "application/json"})


@FUZZ
@given(body=_body({"prompt": prompts}))
def test_fuzzed_completions_never_500(http: httpx.Client, body: dict[str, Any]) -> None:
    _check_answer(_post(http, "/completions", body), body)


@FUZZ
@given(body=_body({"messages": messages, "max_completion_tokens": small_ints}))
def test_fuzzed_chat_completions_never_500(http: httpx.Client, body: dict[str, Any]) -> None:
    _check_answer(_post(http, "/chat/completions", body), body)
