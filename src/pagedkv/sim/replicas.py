"""Several engine replicas behind ``pagedkv router``'s own policy code, on one virtual clock.

``--replicas N --router cache-aware|least-load|round-robin`` (``--compare router=...``,
``pagedkv plan --search replicas``). Each replica is a whole simulated engine (its own
scheduler, KV pool, tiers and clock: :class:`~pagedkv.sim.simulator._Run`). Every arrival, a
chat's next turn included, is routed when its time comes by :mod:`pagedkv.route`'s policy, the
code the router runs, over a :class:`~pagedkv.route.index.PrefixIndex` fed by the replicas' own
KV events (cache-aware only: the other two never read it), each replica's load being the
requests it holds (admitted and not finished, plus those routed to it and not yet admitted).
Events run in time order::

    while requests remain:
        t = the earliest next event of any replica
        if the next arrival is at or before t:  route it -> that replica's arrivals
        else:                                   that replica admits and steps once,
                                                its KV events go to the index

All replicas share one recorder, so the report's latency percentiles cover every request; it
adds the requests routed to each replica and the policy's reasons. The underscore spellings
(``round_robin``, ``least_load``, ``cache_aware``) are accepted for the hyphenated names.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import Counter
from dataclasses import replace

from pagedkv.core.hashing import HashContext, hash_blocks
from pagedkv.errors import InvalidRequestError
from pagedkv.route.index import PrefixIndex, apply_events
from pagedkv.route.policy import POLICY_NAMES, EngineLoad, make_policy
from pagedkv.sim.report import SimReport
from pagedkv.sim.simulator import Progress, SimConfig, _Run, build_report
from pagedkv.sim.workload import SimRequest, Workload

ROUTER_ALIASES = {name.replace("-", "_"): name for name in POLICY_NAMES}


def router_name(name: str) -> str:
    """The router policy's own (hyphenated) name for ``name``; InvalidRequestError if none."""
    n = name.strip().lower()
    n = ROUTER_ALIASES.get(n, n)
    if n not in POLICY_NAMES:
        raise InvalidRequestError(
            f"unknown router {name!r}; known: {', '.join(POLICY_NAMES)} "
            f"(or {', '.join(ROUTER_ALIASES)})"
        )
    return n


class _Router:
    """The policy, its index and its counters over ``runs`` (replica ``i`` is engine ``i``)."""

    def __init__(self, cfg: SimConfig, runs: list[_Run]) -> None:
        self.runs = runs
        self.index: PrefixIndex[int] = PrefixIndex()
        self.policy = make_policy(cfg.router, self.index)
        self.uses_index = cfg.router == "cache-aware"
        self.block_size = cfg.cache.block_size
        self.model_id = cfg.cache.model_id
        self.algo = cfg.cache.hash_algo
        self.per_replica = [0] * len(runs)
        self.reasons: Counter[str] = Counter()

    def route(self, item: tuple[float, int, SimRequest]) -> None:
        sim = item[2]
        hashes: list[bytes] = []
        if self.uses_index:
            ctx = HashContext(model_id=self.model_id, cache_salt=sim.cache_salt, algo=self.algo)
            hashes = hash_blocks(sim.prompt_token_ids, self.block_size, ctx)
        loads = [EngineLoad(i, len(r.tracks) + len(r.arrivals)) for i, r in enumerate(self.runs)]
        decision = self.policy.choose(hashes, loads)
        if self.uses_index:
            self.index.note_routed(decision.engine, hashes)
        self.per_replica[decision.engine] += 1
        self.reasons[decision.reason] += 1
        heapq.heappush(self.runs[decision.engine].arrivals, item)

    def step(self, i: int) -> None:
        run = self.runs[i]
        run.advance()
        if self.uses_index:
            apply_events(self.index, i, run.sched.manager.pool.drain_events())


def simulate_replicas(
    workload: Workload, cfg: SimConfig, progress: Progress | None = None
) -> SimReport:
    """Run ``workload`` over ``cfg.num_replicas`` replicas routed by ``cfg.router``."""
    if cfg.num_replicas < 1:  # pragma: no cover  (SimConfig refuses it)
        raise InvalidRequestError(f"num_replicas must be positive, got {cfg.num_replicas}")
    wall0 = time.perf_counter()
    if cfg.router == "cache-aware":  # the index is fed by the replicas' KV events
        cfg = replace(cfg, cache=replace(cfg.cache, enable_events=True))
    head = _Run(workload, cfg, None)
    runs = [head] + [
        _Run(workload, cfg, None, replica_of=head) for _ in range(cfg.num_replicas - 1)
    ]
    pending = head.arrivals  # the router's queue: open-loop arrivals and released followers
    head.arrivals = []
    for r in runs:
        r.released = pending
    router = _Router(cfg, runs)
    steps = 0
    while pending or any(r.arrivals or r.tracks for r in runs):
        i = min(range(len(runs)), key=lambda k: runs[k].next_event_s())
        t_next = runs[i].next_event_s()
        if pending and pending[0][0] <= t_next:
            router.route(heapq.heappop(pending))
            continue
        if math.isinf(t_next):  # pragma: no cover  (the loop condition excludes it)
            break
        router.step(i)
        steps += 1
        if progress is not None and steps % 256 == 0:
            progress(sum(r.num_done for r in runs), len(workload), runs[i].clock)
    if progress is not None:
        progress(sum(r.num_done for r in runs), len(workload), max(r.clock for r in runs))
    return build_report(
        runs,
        time.perf_counter() - wall0,
        requests_per_replica=tuple(router.per_replica),
        route_decisions=tuple(sorted(router.reasons.items())),
    )
