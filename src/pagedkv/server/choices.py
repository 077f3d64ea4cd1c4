"""One request's ``choices``: text (with an echoed prompt), logprobs and tool calls, for the
whole answer and for each streamed event.

Streamed events add up to the whole answer: each event carries the text since the last one,
holding back a tail that could still start a stop string or a tool call; the logprobs of every
token since the last event; and, when the sample finishes, its tool calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedkv.engine.outputs import CompletionOutput, GenerationOutput
from pagedkv.server.logprobs import LogprobFormatter
from pagedkv.server.tool_calls import ParsedOutput, ToolPlan


@dataclass(frozen=True, slots=True)
class ChoiceShape:
    """How to render a request's choices."""

    chat: bool
    stops: tuple[str, ...] = ()
    logprobs: LogprobFormatter | None = None  # set when the request asked for logprobs
    echo: str = ""  # completions: the prompt text, prepended to each choice
    tools: ToolPlan | None = None

    def final(self, c: CompletionOutput) -> dict[str, Any]:
        """A non-streamed choice."""
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
        choice["logprobs"] = self._logprobs(c, 0, len(self.echo))
        choice["finish_reason"] = finish
        return choice

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


@dataclass(slots=True)
class ChoiceStream:
    """What has been streamed of each choice; :meth:`choices` renders the next event."""

    shape: ChoiceShape
    _sent: dict[int, _Sent] = field(default_factory=dict)

    def choices(self, out: GenerationOutput) -> list[dict[str, Any]]:
        events = []
        for c in out.outputs:
            sent = self._sent.setdefault(c.index, _Sent(offset=len(self.shape.echo)))
            if not sent.done:
                choice = self._choice(c, sent)
                if choice is not None:
                    events.append(choice)
        return events

    def _choice(self, c: CompletionOutput, sent: _Sent) -> dict[str, Any] | None:
        shape = self.shape
        finished = c.finish_reason is not None
        parsed = shape._parsed(c) if finished else None
        end = self._releasable(c, parsed)
        delta = c.text[sent.chars : end] if end > sent.chars else ""
        if not delta and not finished:
            return None
        if not shape.chat and shape.echo and sent.chars == 0 and sent.tokens == 0:
            delta = shape.echo + delta  # the echoed prompt opens the stream
        sent.chars = max(sent.chars, end)
        choice: dict[str, Any] = {"index": c.index}
        logprobs = shape._logprobs(c, sent.tokens, sent.offset)
        if c.logprobs is not None:
            if logprobs is not None and not shape.chat:
                sent.offset += sum(len(t) for t in logprobs["tokens"])
            sent.tokens = len(c.logprobs)
        if shape.chat:
            d: dict[str, Any] = {"content": delta} if delta else {}
            if parsed is not None and parsed.tool_calls:
                d["tool_calls"] = [t.to_openai(i) for i, t in enumerate(parsed.tool_calls)]
            choice["delta"] = d
            if logprobs is not None:
                choice["logprobs"] = logprobs
        else:
            choice.update(text=delta, logprobs=logprobs)
        choice["finish_reason"] = None if parsed is None else shape._finish(parsed, c)
        sent.done = finished
        return choice

    def _releasable(self, c: CompletionOutput, parsed: ParsedOutput | None) -> int:
        """Characters of the text that are content and may be sent now."""
        text = c.text
        if parsed is not None:  # finished
            return len(parsed.content or "") if parsed.tool_calls else len(text)
        end = len(text) - stop_prefix_len(text, self.shape.stops)
        if self.shape.tools is not None and self.shape.tools.parses:
            end = min(end, self.shape.tools.releasable(text))
        return end


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    longest = min(len(text), max((len(s) for s in stops), default=1) - 1)
    for k in range(longest, 0, -1):
        tail = text[-k:]
        if any(len(s) > k and s.startswith(tail) for s in stops):
            return k
    return 0
