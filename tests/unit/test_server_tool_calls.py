"""Tool-call parsers (hermes, llama3_json), tool_choice plans, and the streamed choices of a
tool-calling answer adding up to the whole one, token by token."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.outputs import CompletionOutput, GenerationOutput
from pagedkv.errors import InvalidRequestError
from pagedkv.server.choices import ChoiceShape, ChoiceStream
from pagedkv.server.tool_calls import (
    HermesToolParser,
    Llama3JsonToolParser,
    ToolPlan,
    plan_tools,
)

pytestmark = pytest.mark.engine

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def test_hermes_parses_calls_and_keeps_leading_content() -> None:
    text = 'Sure. <tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    text += '<tool_call>{"name": "g", "arguments": "{\\"y\\": [2]}"}</tool_call>'
    parsed = HermesToolParser().parse(text)
    assert parsed.content == "Sure. "
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("f", {"x": 1}),
        ("g", {"y": [2]}),
    ]
    assert len({c.id for c in parsed.tool_calls}) == 2


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f", "arguments": "{bad"}</tool_call>',
    ],
)
def test_hermes_leaves_unparsable_text_as_content(text: str) -> None:
    parsed = HermesToolParser().parse(text)
    assert parsed.content == text
    assert parsed.tool_calls == ()


def test_hermes_holds_back_a_possible_tag() -> None:
    p = HermesToolParser()
    assert p.releasable("hello <tool") == len("hello ")
    assert p.releasable("hello <tool_call>{") == len("hello ")
    assert p.releasable("a < b") == len("a < b")


def test_llama3_json_parses_one_or_several_calls() -> None:
    p = Llama3JsonToolParser()
    one = p.parse(' {"name": "f", "parameters": {"a": true}}')
    assert one.content is None
    assert [(c.name, json.loads(c.arguments)) for c in one.tool_calls] == [("f", {"a": True})]
    two = p.parse('{"name": "f", "parameters": {}}; {"name": "g", "arguments": {"b": 1}}')
    assert [c.name for c in two.tool_calls] == ["f", "g"]
    for text in ("plain answer", '{"name": "f"} trailing', '{"x": 1}'):
        assert p.parse(text).content == text
    assert p.releasable("  {") == 0
    assert p.releasable("<|py") == 0
    assert p.releasable("Hello") == 5


def test_plans_for_each_tool_choice() -> None:
    kw: dict[str, Any] = {"parser": "hermes", "enable_auto_tool_choice": True}
    assert plan_tools(None, None, **kw) is None
    assert plan_tools(TOOLS, "none", **kw) == ToolPlan("none")
    auto = plan_tools(TOOLS, None, **kw)
    assert auto is not None
    assert auto.mode == "auto"
    required = plan_tools(TOOLS, "required", **kw, parallel_tool_calls=False)
    assert required is not None
    assert required.structured is not None
    schema = json.loads(required.structured.json or "")
    assert schema["maxItems"] == 1
    assert schema["items"]["anyOf"][0]["properties"]["name"] == {"type": "string", "enum": ["f"]}
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "f"}}, **kw)
    assert named is not None
    assert named.function == "f"
    with pytest.raises(InvalidRequestError, match="enable-auto-tool-choice"):
        plan_tools(TOOLS, "auto", parser=None, enable_auto_tool_choice=False)
    with pytest.raises(InvalidRequestError, match="not in tools"):
        plan_tools(TOOLS, {"type": "function", "function": {"name": "zzz"}}, **kw)
    with pytest.raises(InvalidRequestError, match="needs tools"):
        plan_tools(None, "required", **kw)


def _outputs(text: str, cuts: list[int], finish: str) -> list[GenerationOutput]:
    """The growing text of one sample, cut at ``cuts``; the last output finishes."""
    ends = sorted({*cuts, len(text)})
    outs = []
    for end in ends:
        reason = finish if end == len(text) else None
        comp = CompletionOutput(0, text[:end], (), "", (), reason)
        outs.append(GenerationOutput("r", (1,), (comp,), reason is not None, 0, None, 0.0))
    return outs


@settings(max_examples=60, deadline=None)
@given(
    lead=st.sampled_from(["", "Sure. ", "a < b ", "<tool"]),
    call=st.booleans(),
    cuts=st.lists(st.integers(0, 80), max_size=12),
)
def test_streamed_tool_choices_add_up_to_the_whole(lead: str, call: bool, cuts: list[int]) -> None:
    text = lead + ('<tool_call>{"name": "f", "arguments": {"k": "v"}}</tool_call>' if call else "")
    plan = ToolPlan("auto", HermesToolParser())
    shape = ChoiceShape(chat=True, tools=plan)
    outs = _outputs(text, [c for c in cuts if c < len(text)], "stop")
    whole = shape.final(outs[-1].outputs[0])
    stream = ChoiceStream(shape)
    content, calls, finish = "", [], None
    for out in outs:
        for choice in stream.choices(out):
            content += choice["delta"].get("content", "")
            calls += choice["delta"].get("tool_calls", [])
            finish = choice["finish_reason"] or finish
    assert content == (whole["message"]["content"] or "")
    want = [{"index": i, **c} for i, c in enumerate(whole["message"].get("tool_calls", []))]
    assert [{**c, "id": ""} for c in _merged(calls)] == [{**c, "id": ""} for c in want]
    assert finish == whole["finish_reason"] == ("tool_calls" if call else "stop")


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool-call deltas joined as a client does: the first per index opens the call (id, type,
    name); the later ones (index and arguments only) append to its arguments."""
    calls: list[dict[str, Any]] = []
    for d in deltas:
        if d["index"] == len(calls):
            assert set(d) == {"index", "id", "type", "function"}
            calls.append({**d, "function": dict(d["function"])})
        else:
            assert set(d) == {"index", "function"}
            assert set(d["function"]) == {"arguments"}
            calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    return calls


_ARGS = ('{"unit": "c", "days": 3}', '{ "q" : ["a}", {"b": "\\"]"}] }', "{}")
_PLANS: dict[str, tuple[ToolPlan, str]] = {
    # mode -> (plan, the output for calls f(_ARGS[0]), g(_ARGS[1]), h(_ARGS[2]))
    "hermes": (
        ToolPlan("auto", HermesToolParser()),
        "I'll call. "
        + "\n".join(
            f'<tool_call>\n{{"name": "{n}", "arguments": {a}}}\n</tool_call>'
            for n, a in zip("fgh", _ARGS, strict=True)
        ),
    ),
    "llama3_json": (
        ToolPlan("auto", Llama3JsonToolParser()),
        "<|python_tag|>"
        + "; ".join(
            f'{{"name": "{n}", "parameters": {a}}}' for n, a in zip("fgh", _ARGS, strict=True)
        ),
    ),
    "required": (
        ToolPlan("required"),
        "["
        + ", ".join(
            f'{{"name": "{n}", "parameters": {a}}}' for n, a in zip("fgh", _ARGS, strict=True)
        )
        + "]",
    ),
}


@pytest.mark.parametrize("mode", [*_PLANS, "named"])
def test_arguments_stream_in_fragments_that_add_up_to_the_whole(mode: str) -> None:
    if mode == "named":
        plan, text, names = ToolPlan("named", function="f"), _ARGS[0], ["f"]
    else:
        (plan, text), names = _PLANS[mode], ["f", "g", "h"]
    shape = ChoiceShape(chat=True, tools=plan)
    outs = _outputs(text, list(range(len(text))), "stop")  # one character per step
    whole = shape.final(outs[-1].outputs[0])
    stream = ChoiceStream(shape)
    deltas: list[dict[str, Any]] = []
    per_call_events = [0] * len(names)
    for out in outs[:-1]:
        for choice in stream.choices(out):
            assert "content" not in choice["delta"] or mode == "hermes"
            for d in choice["delta"].get("tool_calls", []):
                per_call_events[d["index"]] += 1
            deltas += choice["delta"].get("tool_calls", [])
    for choice in stream.choices(outs[-1]):
        deltas += choice["delta"].get("tool_calls", [])
    got = _merged(deltas)
    assert [c["function"]["name"] for c in got] == names
    assert [{**c, "id": ""} for c in got] == [
        {"index": i, **c, "id": ""} for i, c in enumerate(whole["message"]["tool_calls"])
    ]
    assert [json.loads(c["function"]["arguments"]) for c in got] == [
        json.loads(a) for a in _ARGS[: len(names)]
    ]
    # streamed while generated: every call's arguments came in several deltas before the end
    assert all(k >= 2 for k in per_call_events), per_call_events
