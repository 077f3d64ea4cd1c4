"""Request features over real HTTP with the official ``openai`` client: logprobs (equal to
log_softmax of the logits of an offline transformers run), penalties and vLLM's extras,
structured output (every answer parses and validates, even from random weights) and tool calls,
each streamed and not, the streamed deltas adding up to the non-streamed answer."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch

from e2e.server_fixtures import MODEL_NAME, ServerHandle, running_server, write_endless_model
from pagedkv.engine.tokenizer import Tokenizer

pytestmark = pytest.mark.engine

PROMPT = "The quick brown fox"
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["home", "work"]},
        "floor": {"type": "integer", "minimum": 0, "maximum": 99},
        "open": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["city", "kind", "floor", "open", "tags"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "unit": {"enum": ["c", "f"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["unit", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"utc": {"type": "boolean"}},
                "required": ["utc"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_endless_model(tmp_path_factory.mktemp("srv-feat") / "m")


@pytest.fixture(scope="module")
def srv(model_dir: Path) -> Iterator[ServerHandle]:
    with running_server(model_dir, tool_call_parser="hermes", enable_auto_tool_choice=True) as h:
        yield h


@pytest.fixture
def client(srv: ServerHandle) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60) as c:
        yield c
    srv.wait_idle()
    srv.check_invariants()


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer(model_dir)


def _validate(value: Any, schema: dict[str, Any]) -> None:
    """The JSON-schema subset SCHEMA and TOOLS use, checked by hand (no jsonschema here)."""
    if "enum" in schema:
        assert value in schema["enum"]
        return
    kind = schema["type"]
    if kind == "object":
        assert isinstance(value, dict)
        assert set(schema["required"]) <= set(value) <= set(schema["properties"])
        for k, v in value.items():
            _validate(v, schema["properties"][k])
    elif kind == "array":
        assert isinstance(value, list)
        assert len(value) <= schema.get("maxItems", len(value))
        for v in value:
            _validate(v, schema["items"])
    elif kind == "string":
        assert isinstance(value, str)
        assert len(value) <= schema.get("maxLength", len(value))
    elif kind == "integer":
        assert isinstance(value, int)
        assert not isinstance(value, bool)
        assert schema.get("minimum", value) <= value <= schema.get("maximum", value)
    elif kind == "boolean":
        assert isinstance(value, bool)


# ---------------------------------------------------------------------- logprobs
def test_completion_logprobs_equal_log_softmax_of_offline_logits(
    client: openai.OpenAI, model_dir: Path, tok: Tokenizer
) -> None:
    from transformers import LlamaForCausalLM

    resp = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0.0, logprobs=3
    )
    choice = resp.choices[0]
    lp = choice.logprobs
    assert lp is not None
    assert lp.tokens
    assert lp.token_logprobs
    assert lp.top_logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    prompt_ids = tok.encode(PROMPT)
    hf = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    # greedy: each token is the argmax; rebuild them from the reference and compare all rows
    ids = list(prompt_ids)
    for i in range(8):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1]
        ref = torch.log_softmax(logits.double(), dim=-1)
        tok_id = int(ref.argmax())
        assert lp.tokens[i] == tok.decode([tok_id], skip_special_tokens=False)
        assert lp.token_logprobs[i] == pytest.approx(float(ref[tok_id]), abs=1e-4)
        top = ref.topk(3)
        pairs = zip(top.indices.tolist(), top.values.tolist(), strict=True)
        want = {tok.decode([t], skip_special_tokens=False): float(v) for t, v in pairs}
        assert lp.top_logprobs[i] == pytest.approx(want, abs=1e-4)
        ids.append(tok_id)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]


def test_echo_with_logprobs_gives_prompt_logprobs(
    client: openai.OpenAI, model_dir: Path, tok: Tokenizer
) -> None:
    from transformers import LlamaForCausalLM

    kw: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 3}
    kw.update(temperature=0.0, echo=True, logprobs=2)
    whole = client.completions.create(**kw).choices[0]
    lp = whole.logprobs
    assert lp is not None
    assert lp.tokens
    assert lp.token_logprobs
    assert lp.top_logprobs
    prompt_ids = tok.encode(PROMPT)
    n = len(prompt_ids)
    assert len(lp.tokens) == n + 3
    assert lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    hf = LlamaForCausalLM.from_pretrained(str(model_dir), torch_dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt_ids])).logits[0].double(), dim=-1)
    for i in range(1, n):
        assert lp.token_logprobs[i] == pytest.approx(float(ref[i - 1, prompt_ids[i]]), abs=1e-4)
        assert len(lp.top_logprobs[i]) <= 3  # the top 2 and the prompt's own token
        assert lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(lp.token_logprobs[i])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n + 3)]
    text, tokens, values = "", [], []
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
                values += c.logprobs.token_logprobs or []
    assert text == whole.text
    assert text.startswith(PROMPT)
    assert (tokens, values) == (lp.tokens, lp.token_logprobs)


def test_streamed_completion_logprobs_add_up_to_the_whole(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 10}
    kw.update(temperature=0.9, seed=7, logprobs=2, echo=False)
    whole = client.completions.create(**kw).choices[0]
    text, tokens, values, offsets = "", [], [], []
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens or []
                values += c.logprobs.token_logprobs or []
                offsets += c.logprobs.text_offset or []
    assert whole.logprobs is not None
    assert text == whole.text
    assert tokens == whole.logprobs.tokens
    assert values == whole.logprobs.token_logprobs
    assert offsets == whole.logprobs.text_offset


def test_echo_prepends_the_prompt(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4}
    plain = client.completions.create(**kw, temperature=0.0).choices[0].text
    echoed = client.completions.create(**kw, temperature=0.0, echo=True).choices[0].text
    assert echoed == PROMPT + plain
    streamed = "".join(
        c.text
        for chunk in client.completions.create(**kw, temperature=0.0, echo=True, stream=True)
        for c in chunk.choices
    )
    assert streamed == echoed


def test_chat_logprobs_shape_and_stream(client: openai.OpenAI, tok: Tokenizer) -> None:
    kw: dict[str, Any] = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 6,
        "temperature": 0.8,
        "seed": 3,
        "logprobs": True,
        "top_logprobs": 4,
    }
    whole = client.chat.completions.create(**kw).choices[0]
    assert whole.logprobs is not None
    assert whole.logprobs.content is not None
    content = whole.logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 4
        assert entry.bytes is not None
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.logprob <= entry.top_logprobs[0].logprob + 1e-6
    assert b"".join(bytes(e.bytes or []) for e in content).decode(errors="replace") == (
        whole.message.content
    )
    streamed = []
    text = ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                streamed += c.logprobs.content
    assert text == whole.message.content
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


# ---------------------------------------------------------------------- sampling features
def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _word(tok: Tokenizer) -> tuple[int, str]:
    """A token that is a whole word of 3+ letters and encodes back to itself."""
    for t in range(tok.vocab_size - 1, 0, -1):
        w = tok.decode([t])
        if len(w) >= 3 and w.isalpha() and _ids(tok, w) == [t] and _ids(tok, w * 3) == [t] * 3:
            return t, w
    raise AssertionError("no whole-word token in the tiny vocabulary")


def test_logit_bias_min_tokens_and_stop_token_ids(client: openai.OpenAI, tok: Tokenizer) -> None:
    fox, word = _word(tok)
    kw: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 8}
    forced = client.completions.create(**kw, temperature=1.0, logit_bias={str(fox): 100})
    assert forced.choices[0].text == word * 8
    stop_at = client.completions.create(
        **kw, temperature=0.0, logit_bias={str(fox): 100}, extra_body={"stop_token_ids": [fox]}
    )
    assert stop_at.choices[0].finish_reason == "stop"
    assert stop_at.usage is not None
    assert stop_at.usage.completion_tokens == 1
    assert stop_at.choices[0].text == ""  # a stop token's text is not shown (vLLM's rule) ...
    shown = client.completions.create(
        **kw,
        temperature=0.0,
        logit_bias={str(fox): 100},
        extra_body={"stop_token_ids": [fox], "include_stop_str_in_output": True},
    )
    assert shown.choices[0].text == word  # ... unless asked for
    later = client.completions.create(
        **kw,
        temperature=0.0,
        logit_bias={str(fox): 100},
        extra_body={"stop_token_ids": [fox], "min_tokens": 3},
    )
    assert later.choices[0].finish_reason == "stop"
    assert later.usage is not None
    assert later.usage.completion_tokens == 4


def test_penalties_stream_like_whole_and_logprobs_stay_raw(
    client: openai.OpenAI, tok: Tokenizer
) -> None:
    kw: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 10, "seed": 8}
    kw.update(presence_penalty=1.5, frequency_penalty=0.5, logprobs=1)
    kw["extra_body"] = {"repetition_penalty": 1.3, "min_p": 0.02}
    whole = client.completions.create(**kw).choices[0]
    chunks = client.completions.create(**kw, stream=True)
    streamed = "".join(c.text for ch in chunks for c in ch.choices)
    assert streamed == whole.text
    fox, _ = _word(tok)
    base: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 4}
    base.update(temperature=0.0, logit_bias={str(fox): 100}, logprobs=0)
    biased = client.completions.create(**base).choices[0].logprobs
    assert biased is not None
    assert biased.token_logprobs is not None
    assert all(v < -0.5 for v in biased.token_logprobs)  # the model's own view, not the bias's


def test_include_stop_str_and_skip_special_tokens(client: openai.OpenAI, tok: Tokenizer) -> None:
    fox, word = _word(tok)
    kw: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 5}
    kw.update(temperature=0.0, logit_bias={str(fox): 100}, stop=[word])
    assert client.completions.create(**kw).choices[0].text == ""
    keep = client.completions.create(**kw, extra_body={"include_stop_str_in_output": True})
    assert keep.choices[0].text == word
    (end,) = _ids(tok, "<|end|>")
    kw = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 2, "temperature": 0.0}
    kw["logit_bias"] = {str(end): 100}
    assert client.completions.create(**kw).choices[0].text == ""
    shown = client.completions.create(**kw, extra_body={"skip_special_tokens": False})
    assert shown.choices[0].text == "<|end|>" * 2


# ---------------------------------------------------------------------- structured output
def test_json_schema_output_always_validates(client: openai.OpenAI) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}
    resp = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "where?"}],
        response_format=fmt,  # type: ignore[arg-type]
        max_tokens=200,
        temperature=1.0,
        n=6,
        seed=11,
    )
    for c in resp.choices:
        assert c.finish_reason == "stop"  # the grammar completed
        _validate(json.loads(c.message.content or ""), SCHEMA)


def test_structured_stream_adds_up_and_guided_kinds(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": 200, "seed": 5}
    kw["extra_body"] = {"guided_json": SCHEMA}
    whole = client.completions.create(**kw).choices[0].text
    _validate(json.loads(whole), SCHEMA)
    chunks = client.completions.create(**kw, stream=True)
    streamed = "".join(c.text for ch in chunks for c in ch.choices)
    assert streamed == whole
    kw["extra_body"] = {"guided_choice": ["yes", "no", "maybe so"]}
    for seed in range(4):
        kw["seed"] = seed
        assert client.completions.create(**kw).choices[0].text in ("yes", "no", "maybe so")
    kw["extra_body"] = {"guided_regex": "[a-c]{2,4}-[0-9]"}
    got = client.completions.create(**kw).choices[0]
    assert re.fullmatch("[a-c]{2,4}-[0-9]", got.text)
    assert got.finish_reason == "stop"
    obj = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=300,
        seed=2,
        extra_body={"response_format": {"type": "json_object"}},
    ).choices[0]
    if obj.finish_reason == "stop":  # free-form JSON may outrun max_tokens; then it is cut
        assert isinstance(json.loads(obj.text), dict)
    else:
        assert obj.finish_reason == "length"


# ---------------------------------------------------------------------- tools
def _chat_tools(client: openai.OpenAI, choice: Any, **kw: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "weather?"}],
        tools=TOOLS,  # type: ignore[arg-type]
        tool_choice=choice,
        max_tokens=200,
        **kw,
    )


def test_tool_choice_required_always_parses(client: openai.OpenAI) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    # one call each: parallel calls would let random weights add items until max_tokens
    resp = _chat_tools(client, "required", n=4, seed=1, temperature=1.0, parallel_tool_calls=False)
    for c in resp.choices:
        assert c.finish_reason == "tool_calls"
        assert c.message.tool_calls is not None
        assert len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            assert call.type == "function"
            assert call.id.startswith("chatcmpl-tool-")
            _validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_named_tool_choice_and_its_stream(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = _chat_tools(client, named, seed=4).choices[0]
    assert whole.finish_reason == "stop"  # OpenAI's reason for a forced function
    assert whole.message.tool_calls is not None
    (call,) = whole.message.tool_calls
    assert call.function.name == "get_weather"
    _validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    deltas = []
    finish = None
    for chunk in _chat_tools(client, named, seed=4, stream=True):
        for c in chunk.choices:
            assert not c.delta.content
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "stop"
    # the first delta opens the call; the later ones append fragments of its arguments
    assert (deltas[0].index, deltas[0].type, deltas[0].function.name) == (
        0,
        "function",
        "get_weather",
    )
    assert deltas[0].id is not None
    assert deltas[0].id.startswith("chatcmpl-tool-")
    assert all(
        (d.index, d.id, d.type, d.function.name) == (0, None, None, None) for d in deltas[1:]
    )
    assert len(deltas) >= 3  # streamed as generated, not in one piece at the end
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_required_tool_call_streams_arguments_that_add_up(client: openai.OpenAI) -> None:
    kw: dict[str, Any] = {"n": 2, "seed": 3, "temperature": 1.0, "parallel_tool_calls": False}
    whole = _chat_tools(client, "required", **kw)
    streamed: dict[int, list[Any]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    for chunk in _chat_tools(client, "required", stream=True, **kw):
        for c in chunk.choices:
            assert not c.delta.content
            streamed[c.index] += c.delta.tool_calls or []
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    for c in whole.choices:
        assert c.message.tool_calls is not None
        (call,) = c.message.tool_calls
        deltas = streamed[c.index]
        assert finish[c.index] == c.finish_reason == "tool_calls"
        assert deltas[0].function.name == call.function.name
        assert len(deltas) >= 3
        assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_tool_choice_auto_and_none_give_plain_content(client: openai.OpenAI) -> None:
    for choice in ("auto", "none"):
        c = _chat_tools(client, choice, seed=9, temperature=0.0).choices[0]
        # random weights write no <tool_call>: the text comes back as content
        assert c.message.tool_calls is None
        assert c.finish_reason == "length"
        assert c.message.content
