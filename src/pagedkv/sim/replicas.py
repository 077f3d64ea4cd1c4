"""Several engine replicas behind a router, on one virtual clock (``--replicas N``).

Each replica is a whole simulated engine (its own scheduler, KV pool and clock). Events run in
time order: a request is routed when its arrival time comes before every replica's next step,
otherwise the replica whose next step is earliest runs it. Routing policies (kept inside the
simulator; the KV-aware router of ``pagedkv.route`` is not modelled here):

* ``round_robin``: arrivals in turn;
* ``least_load``: the replica holding the fewest requests (running and waiting), ties to the
  lowest index.

A closed-loop follower (a chat's next turn) goes to the replica that served the turn it follows
(session affinity: its prefix is cached there). All replicas share one recorder, so latency
percentiles cover every request; the time series interleave the replicas' steps.
"""

from __future__ import annotations

import heapq
import math
import time

from pagedkv.sim.report import SimReport
from pagedkv.sim.simulator import Progress, SimConfig, _Run, build_report
from pagedkv.sim.workload import Workload


def _pick(runs: list[_Run], router: str, turn: int) -> int:
    if router == "round_robin":
        return turn % len(runs)
    return min(range(len(runs)), key=lambda i: (len(runs[i].tracks) + len(runs[i].arrivals), i))


def simulate_replicas(
    workload: Workload, cfg: SimConfig, progress: Progress | None = None
) -> SimReport:
    """Run ``workload`` over ``cfg.num_replicas`` replicas routed by ``cfg.router``."""
    wall0 = time.perf_counter()
    head = _Run(workload, cfg, None)
    runs = [head] + [
        _Run(workload, cfg, None, replica_of=head) for _ in range(cfg.num_replicas - 1)
    ]
    pending = head.arrivals  # the open-loop arrivals: the router's queue
    head.arrivals = []
    turn = 0
    steps = 0
    while pending or any(r.arrivals or r.tracks for r in runs):
        nxt = min(runs, key=lambda r: r.next_event_s())
        t_next = nxt.next_event_s()
        if pending and pending[0][0] <= t_next:
            item = heapq.heappop(pending)
            target = runs[_pick(runs, cfg.router, turn)]
            turn += 1
            heapq.heappush(target.arrivals, item)
            continue
        if math.isinf(t_next):  # pragma: no cover  (the loop condition excludes it)
            break
        nxt.advance()
        steps += 1
        if progress is not None and steps % 256 == 0:
            progress(sum(r.num_done for r in runs), len(workload), nxt.clock)
    if progress is not None:
        progress(sum(r.num_done for r in runs), len(workload), max(r.clock for r in runs))
    return build_report(runs, time.perf_counter() - wall0)
