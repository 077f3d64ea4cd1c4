"""Built-in workloads, made deterministically from a seed.

Each generator takes ``num_requests`` (it stops at the first session boundary past it, so the
count can be slightly higher) and ``rate``, the mean arrival rate of new requests in requests
per simulated second; session-based workloads arrive closed-loop (a turn is sent a think time
after the previous one finishes), so their real rate also depends on how fast they are served.

==========  ===============================================================================
chat        multi-turn sessions; every turn re-sends the system prompt and the whole
            conversation (the previous replies included), so each turn hits the last one's KV
system      independent questions behind one of four long system prompts (Zipf popularity),
            two tenants with different cache salts (tenants never share blocks)
agent       a tool-use loop: one long shared tool specification, then a context that grows by
            each tool call and its result and is re-sent every step
rag         a system prompt and 3 documents from a shared corpus (Zipf popularity, relevance
            order), then a question: only the system prompt and the first document are a
            shared prefix, as in real retrieval
mixed       all four (chat 35%, system 25%, agent 20%, rag 20% of requests and of the rate)
==========  ===============================================================================

Each request also carries a client ``max_tokens`` (see :func:`make_workload`), so admission
that reserves max_tokens reserves more than the request uses, as in production. Arrival gaps
are exponential (Poisson) or gamma with a burstiness. Lengths are uniform in the ranges above;
they are plausible for chat-assistant traffic, not fitted to a published trace.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np

from pagedkv.errors import InvalidRequestError
from pagedkv.sim.workload import VOCAB_HIGH, VOCAB_LOW, SimRequest, Workload, stable_seed, token_run

WORKLOADS = ("mixed", "chat", "system", "agent", "rag")
MAX_TOKENS_MODES = ("drawn", "oracle")
DEFAULT_MAX_CONTEXT = 6_000  # prompt + output of any generated request stays under this

_Gen = Callable[[int, int, float, int, float], list[SimRequest]]
CLIENT_MAX_TOKENS = (256, 512, 1024, 2048, 4096)  # the caps clients commonly send


def _check(num_requests: int, rate: float, max_context: int, burstiness: float) -> None:
    if not (burstiness > 0.0 and math.isfinite(burstiness)):
        raise InvalidRequestError(f"burstiness must be a positive number, got {burstiness}")
    if num_requests <= 0:
        raise InvalidRequestError(f"num_requests must be positive, got {num_requests}")
    if not rate > 0.0:
        raise InvalidRequestError(f"rate must be positive (requests per second), got {rate}")
    if max_context < 1_024:
        raise InvalidRequestError(f"max_context must be >= 1024 tokens, got {max_context}")


def _gap(rng: np.random.Generator, mean_s: float, burstiness: float) -> float:
    """An inter-arrival gap: exponential (Poisson arrivals) at burstiness 1, else gamma with
    shape ``burstiness`` and the same mean (below 1: burstier; above: more regular)."""
    if burstiness == 1.0:
        return float(rng.exponential(mean_s))
    return float(rng.gamma(burstiness, mean_s / burstiness))


def _draw_max_tokens(
    seed: int, name: str, reqs: list[SimRequest], max_context: int
) -> list[SimRequest]:
    """Give each request a client ``max_tokens``: one of :data:`CLIENT_MAX_TOKENS` at least its
    output length (it stopped at EOS before the cap) and at most the room ``max_context`` leaves
    after its prompt, uniformly; the room itself when no cap fits."""
    rng = np.random.default_rng(stable_seed(seed, "max_tokens", name))
    out = []
    for r in reqs:
        room = max(r.output_len, max_context - r.num_prompt_tokens)
        caps = [c for c in CLIENT_MAX_TOKENS if r.output_len <= c <= room]
        cap = caps[int(rng.integers(len(caps)))] if caps else room
        out.append(dataclasses.replace(r, max_tokens=cap))
    return out


def _tokens(rng: np.random.Generator, n: int) -> list[int]:
    return rng.integers(VOCAB_LOW, VOCAB_HIGH, size=n).tolist()  # type: ignore[no-any-return]


def _between(rng: np.random.Generator, low: int, high: int) -> int:
    return int(rng.integers(low, high + 1))


def _zipf_weights(n: int) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1)
    return w / w.sum()  # type: ignore[no-any-return]


def _chat(
    seed: int, num_requests: int, rate: float, max_context: int, burstiness: float
) -> list[SimRequest]:
    rng = np.random.default_rng(stable_seed(seed, "chat"))
    system = token_run(seed, "chat/system", 300)
    mean_turns = 5.0  # turns are uniform in 2..8
    out: list[SimRequest] = []
    t = 0.0
    s = 0
    while len(out) < num_requests:
        t += _gap(rng, mean_turns / rate, burstiness)
        history = list(system)
        prev: str | None = None
        for k in range(_between(rng, 2, 8)):
            user = _tokens(rng, _between(rng, 20, 200))
            n_out = _between(rng, 50, 400)
            if len(history) + len(user) + n_out > max_context:
                break
            reply = _tokens(rng, n_out)
            rid = f"chat-s{s}-t{k}"
            out.append(
                SimRequest(
                    rid,
                    t,
                    tuple(history + user),
                    n_out,
                    session_id=f"chat-s{s}",
                    tag="chat",
                    priority=0,
                    follows=prev,
                    think_s=float(rng.exponential(5.0)) if prev else 0.0,
                    output_token_ids=tuple(reply),
                )
            )
            history += user + reply
            prev = rid
        s += 1
    return out


def _system(
    seed: int, num_requests: int, rate: float, max_context: int, burstiness: float
) -> list[SimRequest]:
    rng = np.random.default_rng(stable_seed(seed, "system"))
    lengths = (2_000, 1_500, 1_000, 800)
    prompts = [token_run(seed, f"system/prompt{i}", n) for i, n in enumerate(lengths)]
    weights = _zipf_weights(len(prompts))
    out: list[SimRequest] = []
    t = 0.0
    for i in range(num_requests):
        t += _gap(rng, 1.0 / rate, burstiness)
        p = int(rng.choice(len(prompts), p=weights))
        tenant = "tenant-a" if rng.random() < 0.7 else "tenant-b"
        user = _tokens(rng, _between(rng, 20, 300))
        n_out = min(_between(rng, 20, 300), max_context - len(prompts[p]) - len(user))
        out.append(
            SimRequest(
                f"system-{i}",
                t,
                tuple(prompts[p] + user),
                max(1, n_out),
                session_id=f"system-{i}",
                tag="system",
                priority=1,
                cache_salt=tenant,
            )
        )
    return out


def _agent(
    seed: int, num_requests: int, rate: float, max_context: int, burstiness: float
) -> list[SimRequest]:
    rng = np.random.default_rng(stable_seed(seed, "agent"))
    tools = token_run(seed, "agent/tools", 1_500)
    mean_steps = 7.5  # steps are uniform in 3..12
    out: list[SimRequest] = []
    t = 0.0
    s = 0
    while len(out) < num_requests:
        t += _gap(rng, mean_steps / rate, burstiness)
        context = tools + _tokens(rng, _between(rng, 100, 400))
        prev: str | None = None
        for k in range(_between(rng, 3, 12)):
            n_out = _between(rng, 20, 120)
            if len(context) + n_out > max_context:
                break
            call = _tokens(rng, n_out)
            rid = f"agent-s{s}-k{k}"
            out.append(
                SimRequest(
                    rid,
                    t,
                    tuple(context),
                    n_out,
                    session_id=f"agent-s{s}",
                    tag="agent",
                    priority=2,
                    follows=prev,
                    think_s=float(rng.exponential(0.5)) if prev else 0.0,
                    output_token_ids=tuple(call),
                )
            )
            context = context + call + _tokens(rng, _between(rng, 50, 600))  # + the tool result
            prev = rid
        s += 1
    return out


def _rag(
    seed: int, num_requests: int, rate: float, max_context: int, burstiness: float
) -> list[SimRequest]:
    rng = np.random.default_rng(stable_seed(seed, "rag"))
    system = token_run(seed, "rag/system", 150)
    num_docs = 40
    docs = [token_run(seed, f"rag/doc{d}", _between(rng, 200, 1_000)) for d in range(num_docs)]
    weights = _zipf_weights(num_docs)
    out: list[SimRequest] = []
    t = 0.0
    for i in range(num_requests):
        t += _gap(rng, 1.0 / rate, burstiness)
        picked = rng.choice(num_docs, size=3, replace=False, p=weights)
        prompt = list(system)
        for d in picked:
            prompt += docs[int(d)]
        prompt += _tokens(rng, _between(rng, 10, 80))
        n_out = min(_between(rng, 30, 250), max_context - len(prompt))
        out.append(
            SimRequest(
                f"rag-{i}",
                t,
                tuple(prompt),
                max(1, n_out),
                session_id=f"rag-{i}",
                tag="rag",
                priority=1,
            )
        )
    return out


_GENERATORS: dict[str, _Gen] = {"chat": _chat, "system": _system, "agent": _agent, "rag": _rag}
_MIX = (("chat", 0.35), ("system", 0.25), ("agent", 0.20), ("rag", 0.20))


def make_workload(
    name: str,
    *,
    seed: int = 0,
    num_requests: int = 400,
    rate: float = 4.0,
    max_context: int = DEFAULT_MAX_CONTEXT,
    burstiness: float = 1.0,
    max_tokens: str = "drawn",
) -> Workload:
    """The built-in workload ``name`` (one of :data:`WORKLOADS`). Same arguments, same requests.

    ``burstiness`` shapes the arrival gaps (1: Poisson; gamma otherwise, as vLLM's benchmark
    does). ``max_tokens="drawn"`` gives each request a client cap above its output length;
    ``"oracle"`` sets none (max_tokens is the true length, as an oracle would).
    """
    _check(num_requests, rate, max_context, burstiness)
    if seed < 0:
        raise InvalidRequestError(f"seed must be >= 0, got {seed}")
    if max_tokens not in MAX_TOKENS_MODES:
        raise InvalidRequestError(
            f"max_tokens must be one of {', '.join(MAX_TOKENS_MODES)}, got {max_tokens!r}"
        )
    if name == "mixed":
        reqs: list[SimRequest] = []
        for part, share in _MIX:
            n = max(1, round(num_requests * share))
            reqs += _GENERATORS[part](seed, n, rate * share, max_context, burstiness)
    else:
        gen = _GENERATORS.get(name)
        if gen is None:
            raise InvalidRequestError(
                f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}"
            )
        reqs = gen(seed, num_requests, rate, max_context, burstiness)
    if max_tokens == "drawn":
        reqs = _draw_max_tokens(seed, name, reqs, max_context)
    return Workload(name, tuple(reqs))
