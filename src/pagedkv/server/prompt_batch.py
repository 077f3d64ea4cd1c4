"""``/v1/completions`` with several prompts (``prompt: [str, ...]`` or ``[[ids], ...]``).

Each prompt is its own engine request with ``n`` samples; the answer has one choice per
sample, ``index = prompt_i * n + sample_j`` (OpenAI's and vLLM's numbering), and ``usage`` sums
the prompts. Requests are added in prompt order before any byte is sent, so a prompt that is
refused (too long: 400, engine full: 429) refuses the whole call and aborts the ones already
added. Streamed, the events of all prompts interleave as their steps finish; each prompt's
events add up to its choices of the whole answer, as for one prompt.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

from pagedkv.engine.outputs import GenerationOutput
from pagedkv.errors import PagedKVError
from pagedkv.server.choices import ChoiceShape, ChoiceStream
from pagedkv.server.responses import error_body, usage

logger = logging.getLogger(__name__)

Streams = Sequence[AsyncGenerator[GenerationOutput, None]]


def reindexed(out: GenerationOutput, prompt_index: int, n: int) -> GenerationOutput:
    """``out`` with each sample's index moved to ``prompt_index * n + index``."""
    base = prompt_index * n
    return replace(out, outputs=tuple(replace(c, index=base + c.index) for c in out.outputs))


async def first_outputs(streams: Streams) -> list[GenerationOutput]:
    """Each stream's first output, in order (this adds the requests); on a failure every
    stream is closed (aborting the requests already added) and the error raised."""
    try:
        return [await s.__anext__() for s in streams]
    except BaseException:
        await close_all(streams)
        raise


async def last_outputs(
    firsts: Sequence[GenerationOutput], streams: Streams
) -> list[GenerationOutput]:
    """Each stream's final output (all read at once); the streams are closed after."""

    async def last(
        out: GenerationOutput, s: AsyncGenerator[GenerationOutput, None]
    ) -> GenerationOutput:
        while not out.finished:
            out = await s.__anext__()
        return out

    try:
        return list(await asyncio.gather(*map(last, firsts, streams)))
    finally:
        await close_all(streams)


async def close_all(streams: Streams) -> None:
    for s in streams:
        with contextlib.suppress(Exception):
            await s.aclose()


def summed_usage(outs: Sequence[GenerationOutput]) -> dict[str, Any]:
    each = [usage(o) for o in outs]
    total = {k: sum(u[k] for u in each) for k in ("prompt_tokens", "completion_tokens")}
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in each)
    return {
        **total,
        "total_tokens": total["prompt_tokens"] + total["completion_tokens"],
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def batch_body(
    rid: str, model: str, finals: Sequence[GenerationOutput], shapes: Sequence[ChoiceShape], n: int
) -> dict[str, Any]:
    """The non-streamed ``text_completion`` of every prompt's finished request."""
    choices = []
    for i, (out, shape) in enumerate(zip(finals, shapes, strict=True)):
        moved = reindexed(out, i, n)
        choices += [shape.final(c, moved) for c in moved.outputs]
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": summed_usage(finals),
    }


async def sse_batch(
    rid: str,
    model: str,
    firsts: Sequence[GenerationOutput],
    streams: Streams,
    shapes: Sequence[ChoiceShape],
    n: int,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[bytes]:
    """The streamed answer of every prompt, ``[DONE]`` last; a failure of one prompt's request
    mid-stream is sent as an ``{"error": ...}`` event and ends the stream (the others abort).
    With ``continuous_usage`` every event carries the usage of all prompts so far."""
    created = int(time.time())

    def event(choices: list[dict[str, Any]], use: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": created,
                                "model": model, "choices": choices}  # fmt: skip
        if include_usage:
            body["usage"] = use
        return f"data: {json.dumps(body)}\n\n".encode()

    queue: asyncio.Queue[tuple[int, GenerationOutput | BaseException | None]] = asyncio.Queue()

    async def drain(i: int) -> None:
        out = firsts[i]
        try:
            await queue.put((i, out))
            while not out.finished:
                out = await streams[i].__anext__()
                await queue.put((i, out))
        except StopAsyncIteration:
            pass
        except Exception as exc:  # reported by the consumer
            await queue.put((i, exc))
        await queue.put((i, None))

    progress = [ChoiceStream(s) for s in shapes]
    last = list(firsts)
    tasks = [asyncio.ensure_future(drain(i)) for i in range(len(firsts))]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                if not isinstance(item, PagedKVError):
                    logger.error("request %s failed while streaming", rid, exc_info=item)
                yield f"data: {json.dumps(error_body(str(item), 'internal_error'))}\n\n".encode()
                return
            else:
                last[i] = item
                choices = progress[i].choices(reindexed(item, i, n))
                if choices:
                    yield event(choices, summed_usage(last) if continuous_usage else None)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # off the streams before closing
        await close_all(streams)  # a client that went away aborts every request here
    if include_usage:
        yield event([], summed_usage(last))
    yield b"data: [DONE]\n\n"
