"""Prefill/decode disaggregation in the router: a prefill engine first, then a decode engine.

With ``--prefill URL`` engines, each generation request is first sent to a prefill engine
(chosen by the same policy over the prefill engines' own index) as a copy with
``max_tokens: 1``, not streamed, one sample. That engine (``pagedkv serve --role prefill``)
computes the prompt's KV, stores its full blocks in the shared Redis/Valkey tier and answers
once they are written. The original request then goes to a decode engine, which loads those
blocks at admission instead of computing them, so its output is the one a single engine gives.

A prefill that fails (engine unreachable, an error answer, blocks not stored) is counted and
skipped: the decode engine computes what it does not find in the tier. The client never sees
the prefill step's answer or its failure.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import httpx

from pagedkv.errors import OverloadedError
from pagedkv.route.policy import RoutingPolicy
from pagedkv.router.engines import EngineRegistry

logger = logging.getLogger(__name__)

_DROP_FOR_PREFILL = ("stream", "stream_options", "max_completion_tokens", "n", "logprobs")


def prefill_body(body: dict[str, Any]) -> bytes:
    """The prefill engine's copy of a request: same prompt and model, one token, no stream."""
    copy = {k: v for k, v in body.items() if k not in _DROP_FOR_PREFILL}
    copy["max_tokens"] = 1
    return json.dumps(copy).encode()


async def run_prefill(
    client: httpx.AsyncClient,
    registry: EngineRegistry,
    chooser: RoutingPolicy[str],
    path: str,
    body: dict[str, Any],
    hashes: list[bytes],
    headers: dict[str, str],
) -> bool:
    """Ask one prefill engine to compute and store the prompt's KV; True when it says it did.
    Never raises for an engine's failure (the decode engine then recomputes)."""
    with registry.lock:
        try:
            decision = chooser.choose(hashes, registry.routable())
        except OverloadedError:
            logger.warning("no prefill engine is healthy; decoding from scratch")
            return False
        url = decision.engine
        registry.engines[url].in_flight += 1
        registry.index.note_routed(url, hashes)
    try:
        resp = await client.post(url + path, content=prefill_body(body), headers=headers)
    except httpx.TransportError as exc:
        registry.mark_failed(url, f"prefill failed: {exc}")
        return False
    finally:
        registry.release(url)
    if resp.status_code != 200:
        logger.warning(
            "prefill engine %s answered %d; decoding from scratch", url, resp.status_code
        )
        return False
    return bool(resp.headers.get("x-pagedkv-kv-stored") == "1")
