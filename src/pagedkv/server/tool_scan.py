"""Scanning a running sample's text for tool calls, so their arguments stream as generated.

A call is the JSON object ``{"name": "<fn>", "arguments" | "parameters": <value>, ...}`` with the
name first (what the Hermes, Llama-3 JSON and ``required`` formats write). Once the name and the
opening of an object or array value are in the text, every character after it up to the
value's closing bracket belongs to the arguments, whatever comes next; so a prefix of the text
gives a prefix of the arguments, and the finished call's arguments are the same raw slice
(:func:`raw_arguments`). That is the invariant the stream rests on: the argument fragments
streamed concatenate to the non-streamed ``arguments``.

A call whose keys come in another order, or whose value is a string or a scalar, is not
streamed piecewise: it is sent whole when the sample finishes. Scanning starts from the
beginning of the text at each step: O(text) per step, small for tool calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_WS = " \t\r\n"


@dataclass(frozen=True, slots=True)
class PartialCall:
    """A call seen in a running sample: its name and a sure prefix of its arguments."""

    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class _Scanned:
    call: PartialCall
    end: int | None  # after the object's closing brace; None while it is incomplete


def value_end(text: str, pos: int) -> int | None:
    """The index after the JSON object, array or string starting at ``text[pos]``; None when it
    is not closed yet (or is another kind of value)."""
    if pos >= len(text) or text[pos] not in '{["':
        return None
    depth, in_string, escaped = 0, False, False
    for i in range(pos, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return i + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _WS:
        pos += 1
    return pos


def _scan_call(text: str, pos: int) -> _Scanned | None:
    """The call whose object starts at ``text[pos]``; None until its name is complete, or when
    it does not start with its name."""
    head = _HEAD.match(text, pos)
    if head is None:
        return None
    start = head.end()
    if start >= len(text) or text[start] not in "{[":
        return _Scanned(PartialCall(head.group(1), ""), None)  # sent whole when finished
    end = value_end(text, start)
    if end is None:
        return _Scanned(PartialCall(head.group(1), text[start:]), None)
    close = skip_ws(text, end)
    obj_end = close + 1 if close < len(text) and text[close] == "}" else None
    return _Scanned(PartialCall(head.group(1), text[start:end]), obj_end)


def raw_arguments(obj_text: str) -> tuple[str, str] | None:
    """(name, arguments as written) of a complete call object, when it streams piecewise."""
    scanned = _scan_call(obj_text, skip_ws(obj_text, 0))
    if scanned is None or scanned.end is None or not scanned.call.arguments:
        return None
    return scanned.call.name, scanned.call.arguments


def scan_calls(text: str, pos: int, separator: str, opener: str = "") -> list[PartialCall]:
    """Calls written one after another from ``text[pos]``: each object is preceded by
    ``opener`` (Hermes' ``<tool_call>``) or separated from the previous by ``separator``
    (``;`` for Llama-3 JSON, ``,`` inside ``required``'s array). Stops at the first call not
    yet readable."""
    calls: list[PartialCall] = []
    while True:
        if opener:
            at = text.find(opener, pos)
            if at < 0:
                return calls
            pos = at + len(opener)
        pos = skip_ws(text, pos)
        scanned = _scan_call(text, pos)
        if scanned is None:
            return calls
        calls.append(scanned.call)
        if scanned.end is None:
            return calls
        pos = skip_ws(text, scanned.end)
        if not opener:
            if not text.startswith(separator, pos):
                return calls
            pos = skip_ws(text, pos + len(separator))
