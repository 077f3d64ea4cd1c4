"""Several simulated engines behind a router running the real routing policy.

``pagedkv simulate --replicas N --route-policy POLICY``: each replica is a real :class:`Scheduler`
with its own KV cache manager and its own virtual clock; a request is routed when it arrives,
by :mod:`pagedkv.route`'s policy (the code ``pagedkv router`` runs) over a
:class:`PrefixIndex` fed by the replicas' own KV events, with each replica's running + waiting
count as its load. The loop processes events in time order::

    while requests remain:
        t = the earliest clock of a replica with work
        if the next arrival is at or before t:  route it (hashes, index, loads) -> that replica
        else:                                   step that replica (schedule, cost, update),
                                                apply its KV events to the index

Tokens are the single-replica simulator's (the ``i``-th output token of a request is drawn from
the seed and its id), so policies compare on identical work. Speculative decoding is not
modelled here (``num_draft_tokens`` must be 0).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np

from pagedkv.core.hashing import HashContext, hash_blocks
from pagedkv.errors import InvalidRequestError, InvariantViolation, OverloadedError
from pagedkv.route.index import PrefixIndex, apply_events
from pagedkv.route.policy import CacheAwareConfig, EngineLoad, make_policy
from pagedkv.sched.request import Request
from pagedkv.sched.scheduler import Scheduler
from pagedkv.sim.cost_model import step_totals
from pagedkv.sim.report import Percentiles
from pagedkv.sim.simulator import SimConfig
from pagedkv.sim.workload import VOCAB_HIGH, VOCAB_LOW, SimRequest, Workload, stable_seed


@dataclass(frozen=True, slots=True)
class ClusterReport:
    """What one policy did with the workload over ``num_replicas`` replicas.

    ``prefix_hit_rate``: prompt tokens served from a replica's cache at (last) admission over
    all prompt tokens; TTFT and ITL in simulated seconds; ``requests_per_replica`` counts routed
    requests; ``decisions`` counts the policy's reasons (``cache``, ``room``, ``balance``, ...).
    """

    policy: str
    num_replicas: int
    num_requests: int
    num_finished: int
    num_rejected: int
    makespan_s: float
    prefix_hit_rate: float
    ttft_s: Percentiles
    itl_s: Percentiles
    requests_per_replica: tuple[int, ...]
    decisions: tuple[tuple[str, int], ...]


@dataclass(slots=True)
class _Track:
    sim: SimRequest
    req: Request
    replica: int
    output: list[int]
    first_s: float = -1.0
    last_s: float = -1.0


class _Replica:
    __slots__ = ("clock", "sched", "tracks")

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.clock = 0.0  # the end of its last step (or the arrival that woke it)
        self.tracks: dict[str, _Track] = {}


def _output(sim: SimRequest, seed: int) -> list[int]:
    if sim.output_token_ids is not None:
        return list(sim.output_token_ids)
    rng = np.random.default_rng(stable_seed(seed, "output", sim.request_id))
    return [int(t) for t in rng.integers(VOCAB_LOW, VOCAB_HIGH, size=sim.output_len)]


class _ClusterSim:
    """The state of one run (see the module docstring for the loop)."""

    def __init__(
        self, workload: Workload, cfg: SimConfig, num_replicas: int, policy: str,
        cache_aware: CacheAwareConfig | None,
    ) -> None:  # fmt: skip
        cache = replace(cfg.cache, enable_events=True)  # the index is fed by the events
        self.cfg = cfg
        self.replicas = [_Replica(Scheduler(cfg.scheduler, cache)) for _ in range(num_replicas)]
        self.index: PrefixIndex[int] = PrefixIndex()
        self.policy = make_policy(policy, self.index, cache_aware)
        self.block_size = cache.block_size
        self.model_id = cache.model_id
        self.algo = cache.hash_algo
        self.order = {r.request_id: i for i, r in enumerate(workload.requests)}
        self.arrivals: list[tuple[float, int, SimRequest]] = []
        self.followers: dict[str, list[SimRequest]] = {}
        for r in workload.requests:
            if r.follows is None:
                self.arrivals.append((r.arrival_s, self.order[r.request_id], r))
            else:
                self.followers.setdefault(r.follows, []).append(r)
        heapq.heapify(self.arrivals)
        self.ttft: list[float] = []
        self.itl: list[float] = []
        self.reasons: Counter[str] = Counter()
        self.per_replica = [0] * num_replicas
        self.num_rejected = self.num_finished = self.num_prompt = self.num_cached = 0
        self.last_finish = workload.requests[0].arrival_s if workload.requests else 0.0

    def route(self, at: float, sim: SimRequest) -> None:
        ctx = HashContext(model_id=self.model_id, cache_salt=sim.cache_salt, algo=self.algo)
        hashes = hash_blocks(sim.prompt_token_ids, self.block_size, ctx)
        loads = [EngineLoad(i, r.sched.num_running + r.sched.num_waiting)
                 for i, r in enumerate(self.replicas)]  # fmt: skip
        decision = self.policy.choose(hashes, loads)
        self.index.note_routed(decision.engine, hashes)
        rep = self.replicas[decision.engine]
        req = Request(
            sim.request_id,
            sim.prompt_token_ids,
            max_tokens=sim.output_len,
            priority=sim.priority,
            arrival_time=at,
            cache_salt=sim.cache_salt,
        )
        try:
            rep.sched.add_request(req)
        except (InvalidRequestError, OverloadedError):
            self.num_rejected += 1
            self.release(sim.request_id, at)
            return
        if not rep.tracks:
            rep.clock = max(rep.clock, at)
        rep.tracks[sim.request_id] = _Track(sim, req, decision.engine, _output(sim, self.cfg.seed))
        self.reasons[decision.reason] += 1
        self.per_replica[decision.engine] += 1
        self.num_prompt += len(sim.prompt_token_ids)

    def release(self, rid: str, at: float) -> None:
        for child in self.followers.pop(rid, ()):
            when = max(child.arrival_s, at + child.think_s)
            heapq.heappush(self.arrivals, (when, self.order[child.request_id], child))

    def finish(self, rep: _Replica, rid: str) -> None:
        tr = rep.tracks.pop(rid)
        self.num_finished += 1
        self.num_cached += tr.req.num_cached_tokens
        self.last_finish = max(self.last_finish, rep.clock)
        self.release(rid, rep.clock)

    def step(self, index: int) -> None:
        rep = self.replicas[index]
        sched = rep.sched
        out = sched.schedule()
        for rid in out.finished_ids:
            if rid in rep.tracks:
                self.finish(rep, rid)
        if out.is_empty:
            if out.preempted_ids or out.finished_ids:
                return
            raise InvariantViolation(
                f"replica {index} scheduled nothing with {len(rep.tracks)} requests unfinished"
            )
        rep.clock += self.cfg.cost.step_time(*step_totals(out))
        sampled: dict[str, list[int]] = {}
        for sr in out.scheduled:
            if sr.samples:
                tr = rep.tracks[sr.request_id]
                sampled[sr.request_id] = [tr.output[tr.req.num_output_tokens]]
        for res in sched.update(out, sampled):
            tr = rep.tracks[res.request_id]
            if tr.first_s < 0.0:
                tr.first_s = rep.clock
                self.ttft.append(rep.clock - tr.req.arrival_time)
            else:
                self.itl.append(rep.clock - tr.last_s)
            tr.last_s = rep.clock
            if res.finished:
                self.finish(rep, res.request_id)
        apply_events(self.index, index, sched.manager.pool.drain_events())

    def run(self) -> None:
        steps = 0
        while True:
            busy = [i for i, r in enumerate(self.replicas) if r.tracks]
            t = min((self.replicas[i].clock for i in busy), default=math.inf)
            if self.arrivals and self.arrivals[0][0] <= t:
                at, _, sim = heapq.heappop(self.arrivals)
                self.route(at, sim)
                continue
            if not busy:
                return
            steps += 1
            if steps > self.cfg.max_steps:
                raise InvariantViolation(f"simulation passed max_steps={self.cfg.max_steps}")
            self.step(min(busy, key=lambda i: self.replicas[i].clock))


def simulate_cluster(
    workload: Workload,
    config: SimConfig | None = None,
    *,
    num_replicas: int,
    policy: str,
    cache_aware: CacheAwareConfig | None = None,
) -> ClusterReport:
    """Run ``workload`` over ``num_replicas`` replicas routed by ``policy``."""
    cfg = config or SimConfig()
    if num_replicas < 1:
        raise InvalidRequestError(f"--replicas must be >= 1, got {num_replicas}")
    if cfg.num_draft_tokens:
        raise InvalidRequestError("speculative decoding is not simulated with --replicas")
    sim = _ClusterSim(workload, cfg, num_replicas, policy, cache_aware)
    sim.run()
    first = workload.requests[0].arrival_s if workload.requests else 0.0
    return ClusterReport(
        policy=policy,
        num_replicas=num_replicas,
        num_requests=len(workload),
        num_finished=sim.num_finished,
        num_rejected=sim.num_rejected,
        makespan_s=max(sim.last_finish - first, 0.0),
        prefix_hit_rate=sim.num_cached / sim.num_prompt if sim.num_prompt else 0.0,
        ttft_s=Percentiles.of(sim.ttft),
        itl_s=Percentiles.of(sim.itl),
        requests_per_replica=tuple(sim.per_replica),
        decisions=tuple(sorted(sim.reasons.items())),
    )
