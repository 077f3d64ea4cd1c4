"""One request's ``choices``: text (with an echoed prompt), logprobs and tool calls, for the
whole answer and for each streamed event.

Streamed events add up to the whole answer: each event carries the text since the last one,
holding back a tail that could still start a stop string or a tool call; the logprobs of every
token since the last event; and the tool-call deltas since the last one: a call's first delta
(``id``, ``type``, ``name``) once its name is written, then fragments of its ``arguments``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine.outputs import CompletionOutput, GenerationOutput
from pagedkv.server.logprobs import LogprobFormatter
from pagedkv.server.tool_calls import ParsedOutput, ToolPlan, new_tool_call_id
from pagedkv.server.tool_scan import PartialCall


@dataclass(frozen=True, slots=True)
class ChoiceShape:
    """How to render a request's choices."""

    chat: bool
    stops: tuple[str, ...] = ()
    logprobs: LogprobFormatter | None = None  # set when the request asked for logprobs
    echo: str = ""  # completions: the prompt text, prepended to each choice
    tools: ToolPlan | None = None

    def final(self, c: CompletionOutput, out: GenerationOutput | None = None) -> dict[str, Any]:
        """A non-streamed choice (``out``: its request, for echoed prompt logprobs)."""
        parsed = self._parsed(c)
        finish = self._finish(parsed, c)
        choice: dict[str, Any] = {"index": c.index}
        if self.chat:
            message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
            if parsed.tool_calls:
                message["tool_calls"] = [t.to_openai() for t in parsed.tool_calls]
            elif message["content"] is None:
                message["content"] = ""
            choice["message"] = message
        else:
            choice["text"] = self.echo + c.text
        prompt = self._prompt_logprobs(out)
        offset = len(self.echo) if prompt is None else _text_end(prompt)
        choice["logprobs"] = _joined(prompt, self._logprobs(c, 0, offset))
        choice["finish_reason"] = finish
        return choice

    def _prompt_logprobs(self, out: GenerationOutput | None) -> dict[str, Any] | None:
        """Completions with echo and logprobs: the prompt's part of ``logprobs``."""
        if out is None or out.prompt_logprobs is None or self.logprobs is None or self.chat:
            return None
        return self.logprobs.prompt(out.prompt_token_ids, out.prompt_logprobs)

    def _parsed(self, c: CompletionOutput) -> ParsedOutput:
        if self.tools is None or not self.tools.parses:
            return ParsedOutput(c.text)
        return self.tools.parse(c.text)

    def _finish(self, parsed: ParsedOutput, c: CompletionOutput) -> str | None:
        if self.tools is None:
            return c.finish_reason
        return self.tools.finish_reason(parsed, c.finish_reason)

    def _logprobs(self, c: CompletionOutput, first: int, offset: int) -> dict[str, Any] | None:
        if self.logprobs is None or c.logprobs is None:
            return None
        records = c.logprobs[first:]
        if self.chat:
            return self.logprobs.chat(records)
        return self.logprobs.completion(records, offset)


@dataclass(slots=True)
class _Sent:
    chars: int = 0  # of the sample's text
    tokens: int = 0  # logprob records
    offset: int = 0  # text_offset of the next token (completions)
    done: bool = False
    opened: bool = False  # an event was sent (it carried the echoed prompt)
    call_chars: list[int] = field(default_factory=list)  # per call sent: arguments chars sent


@dataclass(slots=True)
class ChoiceStream:
    """What has been streamed of each choice; :meth:`choices` renders the next event."""

    shape: ChoiceShape
    _sent: dict[int, _Sent] = field(default_factory=dict)

    def choices(self, out: GenerationOutput) -> list[dict[str, Any]]:
        events = []
        for c in out.outputs:
            sent = self._sent.get(c.index)
            prompt = None
            if sent is None:
                prompt = self.shape._prompt_logprobs(out)
                offset = len(self.shape.echo) if prompt is None else _text_end(prompt)
                sent = self._sent[c.index] = _Sent(offset=offset)
            if not sent.done:
                choice = self._choice(c, sent, prompt)
                if choice is not None:
                    events.append(choice)
        return events

    def _choice(
        self, c: CompletionOutput, sent: _Sent, prompt: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        shape = self.shape
        finished = c.finish_reason is not None
        parsed = shape._parsed(c) if finished else None
        end = self._releasable(c, parsed)
        delta = c.text[sent.chars : end] if end > sent.chars else ""
        calls = self._call_deltas(c, sent, parsed)
        if not delta and not calls and not finished and prompt is None:
            return None
        if not shape.chat and not sent.opened:
            delta = shape.echo + delta  # the echoed prompt opens the stream
        sent.opened = True
        sent.chars = max(sent.chars, end)
        choice: dict[str, Any] = {"index": c.index}
        logprobs = shape._logprobs(c, sent.tokens, sent.offset)
        if c.logprobs is not None:
            if logprobs is not None and not shape.chat:
                sent.offset += sum(len(t) for t in logprobs["tokens"])
            sent.tokens = len(c.logprobs)
        if shape.chat:
            d: dict[str, Any] = {"content": delta} if delta else {}
            if calls:
                d["tool_calls"] = calls
            choice["delta"] = d
            if logprobs is not None:
                choice["logprobs"] = logprobs
        else:
            choice.update(text=delta, logprobs=_joined(prompt, logprobs))
        choice["finish_reason"] = None if parsed is None else shape._finish(parsed, c)
        sent.done = finished
        return choice

    def _call_deltas(
        self, c: CompletionOutput, sent: _Sent, parsed: ParsedOutput | None
    ) -> list[dict[str, Any]]:
        """Tool-call deltas since the last event: the finished calls (``parsed``), or those
        readable so far in the running text (short of a possible stop string)."""
        tools = self.shape.tools
        if tools is None or not tools.parses:
            return []
        if parsed is not None:
            calls: list[PartialCall] = [PartialCall(t.name, t.arguments) for t in parsed.tool_calls]
            ids: list[str] | None = [t.id for t in parsed.tool_calls]
        else:
            text = c.text[: len(c.text) - stop_prefix_len(c.text, self.shape.stops)]
            calls, ids = tools.partial_calls(text), None
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
            if i >= len(sent.call_chars):  # its first delta
                function = {"name": call.name, "arguments": call.arguments}
                cid = new_tool_call_id() if ids is None else ids[i]
                deltas.append({"index": i, "id": cid, "type": "function", "function": function})
                sent.call_chars.append(len(call.arguments))
            elif len(call.arguments) > sent.call_chars[i]:
                more = call.arguments[sent.call_chars[i] :]
                deltas.append({"index": i, "function": {"arguments": more}})
                sent.call_chars[i] = len(call.arguments)
        return deltas

    def _releasable(self, c: CompletionOutput, parsed: ParsedOutput | None) -> int:
        """Characters of the text that are content and may be sent now."""
        text = c.text
        if parsed is not None:  # finished
            return len(parsed.content or "") if parsed.tool_calls else len(text)
        end = len(text) - stop_prefix_len(text, self.shape.stops)
        if self.shape.tools is not None and self.shape.tools.parses:
            end = min(end, self.shape.tools.releasable(text))
        return end


def _text_end(logprobs: dict[str, Any]) -> int:
    """Where text after these completions-shaped logprobs starts."""
    tokens, offsets = logprobs["tokens"], logprobs["text_offset"]
    return int(offsets[-1] + len(tokens[-1])) if tokens else 0


def _joined(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
    """Two completions-shaped logprobs, one after the other."""
    if first is None or then is None:
        return then if first is None else first
    return {k: first[k] + then[k] for k in first}


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    longest = min(len(text), max((len(s) for s in stops), default=1) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(len(s) > k and s.startswith(tail) for s in stops):
            return k
    return 0
