"""A workload: the requests a simulation replays, each with its arrival time and lengths.

A :class:`SimRequest` arrives either at a fixed time (``arrival_s``, open loop, as a trace
replays it) or a think time after an earlier request finishes (``follows`` + ``think_s``, closed
loop, as a chat user answers only after reading the reply). Its output is either given
(``output_token_ids``: a chat's next turn re-sends exactly these tokens, so their KV can be a
prefix hit) or made up by the simulator from its seed.

Token ids are synthetic ints. Shared content (a system prompt, a document) is one run of ids
made by :func:`token_run` from a name, so every request that includes it carries the identical
run and its full blocks hash alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import numpy as np

from pagedkv.errors import InvalidRequestError

VOCAB_LOW = 100  # ids below this are left for special tokens
EOS_TOKEN_ID = 2  # the stop token a request ends with when it stops before max_tokens
VOCAB_HIGH = 32_000  # a Llama-2-sized vocabulary
_CHUNK_TOKENS = (
    256  # token_run draws its ids in chunks so a shorter run is a prefix of a longer one
)


@dataclass(frozen=True, slots=True)
class SimRequest:
    """One simulated request.

    ``arrival_s`` is in simulated seconds from the start. With ``follows`` set, the request
    arrives ``think_s`` after the named (earlier) request finishes, and never before
    ``arrival_s``. ``output_len`` tokens are generated; ``max_tokens`` is what the client asked
    for (at least ``output_len``; ``None``: exactly ``output_len``, an oracle): when it is more,
    the simulated model stops the request with a stop token at ``output_len``, as at EOS;
    lower ``priority`` is served first under the priority policy; ``cache_salt`` separates
    tenants' prefix caches; ``tag`` names the request's class (``chat``, ``rag``, ...) and the
    report breaks latencies down by it.
    """

    request_id: str
    arrival_s: float
    prompt_token_ids: tuple[int, ...]
    output_len: int
    session_id: str = ""
    priority: int = 0
    cache_salt: str | None = None
    follows: str | None = None
    think_s: float = 0.0
    output_token_ids: tuple[int, ...] | None = None
    tag: str = ""
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        rid = self.request_id
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {rid!r}")
        if not self.arrival_s >= 0.0:  # also rejects NaN
            raise InvalidRequestError(f"{rid}: arrival_s must be >= 0, got {self.arrival_s}")
        if not self.think_s >= 0.0:
            raise InvalidRequestError(f"{rid}: think_s must be >= 0, got {self.think_s}")
        if not self.prompt_token_ids:
            raise InvalidRequestError(f"{rid}: the prompt is empty")
        if self.output_len <= 0:
            raise InvalidRequestError(f"{rid}: output_len must be positive, got {self.output_len}")
        if self.max_tokens is not None and self.max_tokens < self.output_len:
            raise InvalidRequestError(
                f"{rid}: max_tokens {self.max_tokens} is below output_len {self.output_len}"
            )
        out = self.output_token_ids
        if out is not None and len(out) != self.output_len:
            raise InvalidRequestError(
                f"{rid}: output_token_ids has {len(out)} tokens but output_len is {self.output_len}"
            )
        if self.follows == rid:
            raise InvalidRequestError(f"{rid}: a request cannot follow itself")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens_limit(self) -> int:
        """``max_tokens``, or ``output_len`` when the request gives none."""
        return self.output_len if self.max_tokens is None else self.max_tokens


@dataclass(frozen=True, slots=True)
class Workload:
    """A named, validated list of requests, sorted by ``arrival_s`` (ties keep their order).

    Invariants (``check_invariants()`` verifies each; the constructor establishes them):
      W1  request ids are unique
      W2  a ``follows`` names a request that comes earlier in ``requests`` (so no cycles)
      W3  ``requests`` is sorted by ``arrival_s``
    """

    name: str
    requests: tuple[SimRequest, ...]

    def __post_init__(self) -> None:
        reqs = tuple(sorted(self.requests, key=lambda r: r.arrival_s))
        object.__setattr__(self, "requests", reqs)
        seen: set[str] = set()
        for r in reqs:
            if r.request_id in seen:
                raise InvalidRequestError(f"duplicate request_id {r.request_id!r}")
            if r.follows is not None and r.follows not in seen:
                raise InvalidRequestError(
                    f"{r.request_id}: follows {r.follows!r}, which is not an earlier request "
                    "(a followed request must arrive no later than its follower)"
                )
            seen.add(r.request_id)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.output_len for r in self.requests)

    @property
    def max_total_tokens(self) -> int:
        """The longest prompt + output: max_model_len must exceed it for nothing to be cut."""
        return max((r.num_prompt_tokens + r.output_len for r in self.requests), default=0)

    @property
    def mean_rate(self) -> float:
        """Requests per second over the span of arrival times: ``(n - 1) / (last - first)``
        (0.0 when fewer than two requests or every request arrives at once)."""
        if len(self.requests) < 2:
            return 0.0
        span = self.requests[-1].arrival_s - self.requests[0].arrival_s
        return (len(self.requests) - 1) / span if span > 0 else 0.0

    def head(self, num_requests: int) -> Workload:
        """The first ``num_requests`` requests by arrival (W2 keeps every ``follows`` inside)."""
        if num_requests <= 0:
            raise InvalidRequestError(f"num_requests must be positive, got {num_requests}")
        if num_requests >= len(self.requests):
            return self
        return Workload(self.name, self.requests[:num_requests])

    def scaled_to_rate(self, rate: float) -> Workload:
        """The same requests with arrival times stretched about the first so that
        :attr:`mean_rate` is ``rate``. Think times are kept: a user's reading time is not load.

        Raises InvalidRequestError when the rate is not positive or the workload has no span
        to scale (one request, or all arriving at once).
        """
        if not (rate > 0.0 and math.isfinite(rate)):
            raise InvalidRequestError(f"rate must be positive (requests per second), got {rate}")
        current = self.mean_rate
        if current == 0.0:
            raise InvalidRequestError(
                f"{self.name}: cannot scale to {rate:g} requests/s: its {len(self.requests)} "
                "request(s) all arrive at the same time"
            )
        factor = current / rate
        t0 = self.requests[0].arrival_s
        scaled = tuple(
            dataclasses.replace(r, arrival_s=t0 + (r.arrival_s - t0) * factor)
            for r in self.requests
        )
        return Workload(self.name, scaled)

    def check_invariants(self) -> None:
        from pagedkv.errors import InvariantViolation

        ids = [r.request_id for r in self.requests]
        if len(set(ids)) != len(ids):
            raise InvariantViolation("W1: duplicate request ids")
        pos = {rid: i for i, rid in enumerate(ids)}
        for i, r in enumerate(self.requests):
            if r.follows is not None and pos.get(r.follows, i) >= i:
                raise InvariantViolation(f"W2: {r.request_id} follows a later or unknown request")
        times = [r.arrival_s for r in self.requests]
        if times != sorted(times):
            raise InvariantViolation("W3: requests are not sorted by arrival_s")


def stable_seed(*parts: int | str) -> list[int]:
    """A numpy seed sequence from ints and strings, the same in every process (no ``hash()``)."""
    out: list[int] = []
    for p in parts:
        if isinstance(p, str):
            digest = hashlib.blake2b(p.encode("utf-8"), digest_size=8).digest()
            out.append(int.from_bytes(digest, "little"))
        else:
            if p < 0:
                raise InvalidRequestError(f"seed parts must be >= 0, got {p}")
            out.append(p)
    return out


def token_run(seed: int, name: str, length: int) -> list[int]:
    """``length`` synthetic token ids named ``name``: the same name and seed always give the same
    ids, and a shorter run is a prefix of a longer one (ids are drawn in fixed chunks)."""
    if length < 0:
        raise InvalidRequestError(f"token run {name!r}: length must be >= 0, got {length}")
    out: list[int] = []
    chunk = 0
    while len(out) < length:
        rng = np.random.default_rng(stable_seed(seed, name, chunk))
        out.extend(rng.integers(VOCAB_LOW, VOCAB_HIGH, size=_CHUNK_TOKENS).tolist())
        chunk += 1
    return out[:length]
