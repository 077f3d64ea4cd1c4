"""Tool calling for chat: what a request's ``tools`` and ``tool_choice`` do, and the parsers
that turn a model's text into OpenAI ``tool_calls``.

``tool_choice`` (vLLM's behaviour):

* ``none``: tools go to the chat template; the output is plain content.
* ``auto`` (the default when tools are given): needs ``--enable-auto-tool-choice`` and a
  ``--tool-call-parser``; the parser finds calls in the text (``hermes``:
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; ``llama3_json``: the output
  is ``{"name": ..., "parameters": {...}}``, several separated by ``;``).
* ``required``: the output is constrained by the grammar engine to a JSON array of at least one
  ``{"name": <a tool>, "parameters": <its schema>}``, so it always parses (no parser needed);
  exactly one with ``parallel_tool_calls: false`` (with ``auto``, only the first call is kept).
* a named function: the output is constrained to that function's parameters schema and becomes
  its arguments. OpenAI reports ``finish_reason: "stop"`` for a forced function and
  ``"tool_calls"`` otherwise.

Streaming: text that may still turn out to be a call is held back (like a stop-string prefix).
A call's first delta carries its ``id``, ``type`` and ``name`` as soon as the name is written;
later deltas append fragments of ``arguments`` as they are generated
(:mod:`pagedkv.server.tool_scan`), and the finished call's ``arguments`` are the same raw text,
so the streamed deltas add up to the non-streamed message. A call that fails to parse when the
sample finishes (cut by ``max_tokens``, or malformed under ``auto``) becomes content in the
whole answer; its stream has already sent the fragments (as vLLM's does).
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pagedkv.engine.sampler import StructuredOutputsParams
from pagedkv.errors import InvalidRequestError
from pagedkv.server.tool_scan import PartialCall, raw_arguments, scan_calls, skip_ws

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)
    id: str = ""

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    """A finished sample's text split into content (``None`` when empty) and tool calls."""

    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _call(obj: object, raw: str | None = None) -> ToolCall | None:
    """``{"name": str, "arguments" | "parameters": object | str}`` -> a call, else None.
    ``raw``, the object's text, gives the arguments as written when they streamed piecewise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    written = None if raw is None else raw_arguments(raw)
    if written is not None and written[0] == obj["name"] and json.loads(written[1]) == args:
        return ToolCall(obj["name"], written[1], new_tool_call_id())
    if isinstance(args, str):
        try:
            json.loads(args)
        except json.JSONDecodeError:
            return None
        return ToolCall(obj["name"], args, new_tool_call_id())
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), new_tool_call_id())


class ToolParser(ABC):
    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The calls in a finished text; unparsable calls leave the whole text as content."""

    @abstractmethod
    def releasable(self, text: str) -> int:
        """How many leading characters of a running sample's text are content for sure."""

    @abstractmethod
    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls readable so far in a running sample's text (arguments: sure prefixes)."""


class HermesToolParser(ToolParser):
    START = "<tool_call>"
    _CALLS = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        at = text.find(self.START)
        if at < 0:
            return ParsedOutput(text or None)
        calls = []
        for m in self._CALLS.finditer(text):
            raw = (m.group(1) if m.group(1) is not None else m.group(2)).strip()
            try:
                call = _call(json.loads(raw), raw)
            except json.JSONDecodeError:
                call = None
            if call is None:
                return ParsedOutput(text or None)
            calls.append(call)
        return ParsedOutput(text[:at] or None, tuple(calls))

    def releasable(self, text: str) -> int:
        at = text.find(self.START)
        if at >= 0:
            return at
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):
            if text.endswith(self.START[:k]):
                return len(text) - k
        return len(text)

    def partial_calls(self, text: str) -> list[PartialCall]:
        return scan_calls(text, 0, "", opener=self.START)


class Llama3JsonToolParser(ToolParser):
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip().removeprefix(self.PYTHON_TAG).lstrip()
        if not body.startswith("{"):
            return ParsedOutput(text or None)
        decoder = json.JSONDecoder()
        calls = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError:
                return ParsedOutput(text or None)
            call = _call(obj, body[pos:end])
            if call is None:
                return ParsedOutput(text or None)
            calls.append(call)
            pos = end
            rest = body[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return ParsedOutput(text or None)
            pos = len(body) - len(rest)
        return ParsedOutput(None, tuple(calls))

    def releasable(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith("{") or self.PYTHON_TAG.startswith(head[:14]):
            return 0  # may be (the start of) a call: hold it back
        return len(text)

    def partial_calls(self, text: str) -> list[PartialCall]:
        pos = skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, pos):
            pos = skip_ws(text, pos + len(self.PYTHON_TAG))
        return scan_calls(text, pos, ";")


PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """What one chat request does with its tools: ``mode`` is ``none``, ``auto``,
    ``required`` or ``named``; ``structured`` constrains the output for the last two."""

    mode: str
    parser: ToolParser | None = None
    function: str | None = None
    structured: StructuredOutputsParams | None = None
    parallel: bool = True

    def parse(self, text: str) -> ParsedOutput:
        if self.mode == "auto" and self.parser is not None:
            parsed = self.parser.parse(text)
            if not self.parallel and len(parsed.tool_calls) > 1:
                return ParsedOutput(parsed.content, parsed.tool_calls[:1])
            return parsed
        if self.mode == "named" and self.function is not None:
            try:
                json.loads(text)
            except json.JSONDecodeError:
                return ParsedOutput(text or None)
            return ParsedOutput(None, (ToolCall(self.function, text, new_tool_call_id()),))
        if self.mode == "required":
            calls = _array_calls(text)
            return ParsedOutput(text or None) if calls is None else ParsedOutput(None, calls)
        return ParsedOutput(text or None)

    def partial_calls(self, text: str) -> list[PartialCall]:
        """The calls readable so far in a running sample (see :mod:`pagedkv.server.tool_scan`)."""
        if self.mode == "auto" and self.parser is not None:
            calls = self.parser.partial_calls(text)
            return calls if self.parallel else calls[:1]
        if self.mode == "named" and self.function is not None:
            return [PartialCall(self.function, text)]  # the whole output is the arguments
        if self.mode == "required":
            pos = skip_ws(text, 0)
            return scan_calls(text, pos + 1, ",") if text.startswith("[", pos) else []
        return []

    def releasable(self, text: str) -> int:
        if self.mode == "auto" and self.parser is not None:
            return self.parser.releasable(text)
        return 0 if self.mode in ("required", "named") else len(text)

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def finish_reason(self, parsed: ParsedOutput, engine_reason: str | None) -> str | None:
        if parsed.tool_calls and engine_reason == "stop" and self.mode != "named":
            return "tool_calls"
        return engine_reason


def _array_calls(text: str) -> tuple[ToolCall, ...] | None:
    """``required``'s output, a JSON array of one or more calls, each with its arguments as
    written; None when it is not one."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items:
        return None
    decoder = json.JSONDecoder()
    calls = []
    pos = skip_ws(text, 0) + 1  # after "["
    for item in items:
        pos = skip_ws(text, pos)
        _, end = decoder.raw_decode(text, pos)  # the text parsed as a whole: items parse
        call = _call(item, text[pos:end])
        if call is None:
            return None
        calls.append(call)
        pos = skip_ws(text, end) + 1  # after "," or "]"
    return tuple(calls)


def plan_tools(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    *,
    parser: str | None,
    enable_auto_tool_choice: bool,
    parallel_tool_calls: bool | None = None,
) -> ToolPlan | None:
    """The request's plan (None without tools); raises InvalidRequestError for a choice the
    server cannot honour."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools")
        return None
    functions = _functions(tools)
    parallel = parallel_tool_calls is not False
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none")
    if choice == "auto":
        if not (enable_auto_tool_choice and parser):
            raise InvalidRequestError(
                '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                "to be set"
            )
        return ToolPlan("auto", PARSERS[parser](), parallel=parallel)
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, schema in functions.items()
        ]
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            array["maxItems"] = 1
        structured = StructuredOutputsParams.from_schema(array)
        return ToolPlan("required", structured=structured, parallel=parallel)
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if name not in functions:
            raise InvalidRequestError(f"tool_choice names function {name!r}, not in tools")
        return ToolPlan(
            "named", function=name, structured=StructuredOutputsParams.from_schema(functions[name])
        )
    raise InvalidRequestError(f"tool_choice {choice!r} is not none, auto, required or a function")


def _functions(tools: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Function name -> its parameters schema (an empty object schema when absent)."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, Mapping):
            raise InvalidRequestError(f"tools[{i}] must be {{'type': 'function', 'function': ...}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequestError(f"tools[{i}].function.name must be a non-empty string")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, Mapping):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema")
        out[name] = dict(params)
    return out
