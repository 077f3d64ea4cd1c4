"""One request in flight in the simulator, and the tokens its simulated model emits.

The model is a script: output position ``i`` holds ``output[i]`` (the workload's tokens, or draws
seeded by the simulation seed and the request id, so every variant sees the same tokens), the
last one the stop token when the request stops before ``max_tokens``. Drafts are right with a
fixed probability, drawn from a generator of their own.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from pagedkv.sched.request import Request
from pagedkv.sim.workload import EOS_TOKEN_ID, VOCAB_HIGH, VOCAB_LOW, SimRequest, stable_seed

if TYPE_CHECKING:
    from pagedkv.sim.recorder import TagSamples


_NO_OUTPUT: array[int] = array("q")  # a waiting request's output: drawn when first scheduled


class Track:
    """What the simulator remembers of one admitted request (a hot mutable record).

    Invariant: ``output`` is empty until the request is first scheduled (``sched_s >= 0``),
    then :func:`output_tokens` of it, 8 bytes a token: a long queue holds no outputs.
    """

    __slots__ = (
        "arrival_s",
        "draft_rng",
        "first_s",
        "last_s",
        "num_prompt_tokens",
        "order",
        "output",
        "output_base",
        "req",
        "sched_s",
        "sim",
        "stops",
        "tag_samples",
    )

    def __init__(
        self,
        sim: SimRequest,
        order: int,
        req: Request,
        stops: bool,
        tag_samples: TagSamples,
    ) -> None:
        self.sim = sim
        self.order = order  # its position in the workload (the records name it so)
        self.tag_samples = tag_samples  # the recorder's samples of this request's tag
        self.req = req
        self.num_prompt_tokens = req.num_prompt_tokens  # req's, fixed (the hot loop reads it)
        # a decode at position p (its last token's) samples output[p - output_base]
        self.output_base = req.num_prompt_tokens - 1
        self.arrival_s = req.arrival_time
        self.stops = stops  # it ends with the stop token (max_tokens > output length)
        self.first_s = -1.0  # no token yet
        self.last_s = -1.0
        self.sched_s = -1.0  # not scheduled yet
        self.output = _NO_OUTPUT
        self.draft_rng: np.random.Generator | None = None  # made on the first draft

    def start(self, at: float, seed: int) -> None:
        """First scheduled at ``at``: draw the tokens its simulated model will emit."""
        self.sched_s = at
        self.output = output_tokens(self.sim, seed, self.stops)


def propose_drafts(tr: Track, k: int, p: float, seed: int) -> None:
    """Set ``k`` drafts for the next step: each the true next token with probability ``p``."""
    req = tr.req
    n = req.num_output_tokens
    true_next = tr.output[n : n + k]
    if not true_next:
        return
    if tr.draft_rng is None:
        tr.draft_rng = np.random.default_rng(stable_seed(seed, "draft", tr.sim.request_id))
    right = tr.draft_rng.random(len(true_next)) < p
    req.draft_token_ids = [
        t if ok else (t + 1 if t + 1 < VOCAB_HIGH else VOCAB_LOW)
        for t, ok in zip(true_next, right.tolist(), strict=True)
    ]


def accepted_tokens(tr: Track, drafts: Sequence[int]) -> list[int]:
    """What the simulated model emits after verifying ``drafts``: the drafts up to the first
    wrong one, then the true token at that position."""
    n = tr.req.num_output_tokens
    out = tr.output
    a = 0
    while a < len(drafts) and drafts[a] == out[n + a]:
        a += 1
    return out[n : n + a + 1].tolist()


def output_tokens(sim: SimRequest, seed: int, stops: bool) -> array[int]:
    """The tokens the simulated model samples; the last is the stop token when ``stops``."""
    if sim.output_token_ids is not None:
        out = array("q", sim.output_token_ids)
    else:
        rng = np.random.default_rng(stable_seed(seed, "output", sim.request_id))
        out = array("q", rng.integers(VOCAB_LOW, VOCAB_HIGH, size=sim.output_len).tobytes())
    if stops:
        out[-1] = EOS_TOKEN_ID
    return out
