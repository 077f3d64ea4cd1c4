"""Replay a workload through the real :class:`Scheduler` and :class:`KVCacheManager`.

A virtual clock drives the loop::

    while requests remain:
        add every request whose arrival time has come      (add_request; rejections counted)
        out = scheduler.schedule()                          (wall time measured)
        clock += cost_model.step_time_of(out)               (simulated time)
        scheduler.update(out, one synthetic token per sampling request)
        record first tokens (TTFT), token gaps (ITL), finishes; release followers

A request that ``follows`` another arrives ``think_s`` after that one finishes. The synthetic
token of output position ``i`` is ``output_token_ids[i]`` when the workload gives them (a chat's
next turn re-sends exactly these), otherwise the ``i``-th draw of a generator seeded by the
simulation seed and the request id, so every variant of a comparison produces the same tokens.
Requests never stop early: max_tokens is the output length and there are no stop tokens.

Speculative decoding (``num_draft_tokens = k > 0``): after each step a decoding request gets k
drafts, each the true next token with probability ``draft_acceptance`` (independently, from a
generator seeded by the seed and the request id) and a wrong token otherwise. The scheduler
verifies them in the next step; the simulated model accepts the drafts up to the first wrong
one and adds the true token after them, so 1 to k + 1 tokens arrive per step, exactly as a
prompt-lookup or draft-model speculator behaves. Draft positions cost like prefill tokens.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pagedkv.core.config import CacheConfig
from pagedkv.errors import (
    InvalidRequestError,
    InvariantViolation,
    OverloadedError,
    PromptTooLongError,
    SimulationLimitError,
)
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.request import Request
from pagedkv.sched.scheduler import Scheduler
from pagedkv.sim.cost_model import CostModel, StepCost, step_totals
from pagedkv.sim.report import (
    Percentiles,
    RequestRecord,
    SimReport,
    WallTimings,
    bucket_series,
    summarize_tags,
)
from pagedkv.sim.workload import VOCAB_HIGH, VOCAB_LOW, SimRequest, Workload, stable_seed

logger = logging.getLogger(__name__)

Progress = Callable[[int, int, float], None]
"""``progress(num_done, num_requests, clock_s)``: called every few hundred steps and at the end."""


def _default_scheduler() -> SchedulerConfig:
    return SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=8192)


def _default_cache() -> CacheConfig:
    return CacheConfig(block_size=16, num_blocks=4096, model_id="sim")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulation variant. ``params`` names its settings for tables (e.g. caching=off)."""

    scheduler: SchedulerConfig = field(default_factory=_default_scheduler)
    cache: CacheConfig = field(default_factory=_default_cache)
    cost: StepCost = field(default_factory=CostModel)  # CostModel, RooflineCost, a fitted one
    seed: int = 0
    label: str = "default"
    params: tuple[tuple[str, str], ...] = ()
    max_series_points: int = 2_000
    max_steps: int = 10_000_000  # a guard against a scheduler that never finishes
    num_draft_tokens: int = 0  # speculative drafts per decode step (0: off)
    draft_acceptance: float = 0.7  # probability that each draft is the true next token

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise InvalidRequestError(f"seed must be >= 0, got {self.seed}")
        if self.max_series_points < 2:
            raise InvalidRequestError(
                f"max_series_points must be >= 2, got {self.max_series_points}"
            )
        if self.max_steps <= 0:
            raise InvalidRequestError(f"max_steps must be positive, got {self.max_steps}")
        if self.num_draft_tokens < 0:
            raise InvalidRequestError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if not 0.0 <= self.draft_acceptance <= 1.0:
            raise InvalidRequestError(
                f"draft_acceptance must be in [0, 1], got {self.draft_acceptance}"
            )


class _Track:
    """What the simulator remembers of one admitted request (a hot mutable record)."""

    __slots__ = ("arrival_s", "draft_rng", "first_s", "last_s", "output", "req", "sim")

    def __init__(self, sim: SimRequest, req: Request, arrival_s: float, output: list[int]) -> None:
        self.sim = sim
        self.req = req
        self.arrival_s = arrival_s
        self.first_s = -1.0  # no token yet
        self.last_s = -1.0
        self.output = output
        self.draft_rng: np.random.Generator | None = None  # made on the first draft


def _propose_drafts(tr: _Track, k: int, p: float, seed: int) -> None:
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


def _accepted(tr: _Track, drafts: list[int]) -> list[int]:
    """What the simulated model emits after verifying ``drafts``: the drafts up to the first
    wrong one, then the true token at that position."""
    n = tr.req.num_output_tokens
    out = tr.output
    a = 0
    while a < len(drafts) and drafts[a] == out[n + a]:
        a += 1
    return out[n : n + a + 1]


def _output_tokens(sim: SimRequest, seed: int) -> list[int]:
    if sim.output_token_ids is not None:
        return list(sim.output_token_ids)
    rng = np.random.default_rng(stable_seed(seed, "output", sim.request_id))
    return rng.integers(VOCAB_LOW, VOCAB_HIGH, size=sim.output_len).tolist()  # type: ignore[no-any-return]


def simulate(
    workload: Workload, config: SimConfig | None = None, *, progress: Progress | None = None
) -> SimReport:
    """Run ``workload`` through a fresh scheduler built from ``config`` and report what happened.

    Raises SimulationLimitError when ``config.max_steps`` steps pass with requests left (a limit
    the caller chose), InvariantViolation if the scheduler stops making progress (a bug).
    """
    cfg = config or SimConfig()
    wall0 = time.perf_counter()
    sched = Scheduler(cfg.scheduler, cfg.cache)
    mgr = sched.manager
    cost = cfg.cost

    followers: dict[str, list[SimRequest]] = {}
    arrivals: list[tuple[float, int, SimRequest]] = []  # heap of (time, order, request)
    for order, r in enumerate(workload.requests):
        if r.follows is None:
            arrivals.append((r.arrival_s, order, r))
        else:
            followers.setdefault(r.follows, []).append(r)
    heapq.heapify(arrivals)
    order_of = {r.request_id: i for i, r in enumerate(workload.requests)}

    tracks: dict[str, _Track] = {}
    records: list[RequestRecord] = []
    num_done = num_rejected = num_truncated = 0
    num_prompt = num_output = 0
    ttft: list[float] = []
    ttft_at: list[float] = []
    itl: list[float] = []
    e2e: list[float] = []
    tpot: list[float] = []
    by_tag: dict[str, tuple[list[float], list[float], list[float]]] = {}  # ttft, itl, e2e
    series_t: list[float] = []
    series_usage: list[float] = []
    series_running: list[int] = []
    series_waiting: list[int] = []
    series_step: list[float] = []
    sched_cpu: list[int] = []  # ns
    sched_wall: list[int] = []
    admit_wall: list[float] = []  # s
    update_cpu: list[int] = []
    update_wall: list[int] = []
    cpu_ns = time.thread_time_ns
    wall_ns = time.perf_counter_ns
    first_arrival = workload.requests[0].arrival_s if workload.requests else 0.0
    clock = first_arrival
    last_finish = first_arrival
    prefill_computed = 0
    num_drafts = num_accepted = 0
    spec_k = cfg.num_draft_tokens

    def release(rid: str, at: float) -> None:
        for child in followers.pop(rid, ()):
            when = max(child.arrival_s, at + child.think_s)
            heapq.heappush(arrivals, (when, order_of[child.request_id], child))

    def tag_lists(tag: str) -> tuple[list[float], list[float], list[float]]:
        lists = by_tag.get(tag)
        if lists is None:
            lists = by_tag[tag] = ([], [], [])
        return lists

    def finish(rid: str, at: float) -> None:
        nonlocal num_done, num_truncated, last_finish, num_output
        tr = tracks.pop(rid)
        num_done += 1
        produced = tr.req.num_output_tokens
        num_output += produced
        if produced < tr.sim.output_len:
            num_truncated += 1
        if tr.last_s >= 0.0:
            e2e.append(tr.last_s - tr.arrival_s)
            if produced > 1:
                tpot.append((tr.last_s - tr.first_s) / (produced - 1))
            tag_lists(tr.sim.tag)[2].append(tr.last_s - tr.arrival_s)
        req = tr.req
        records.append(
            RequestRecord(
                rid,
                tr.sim.session_id,
                tr.sim.tag,
                tr.arrival_s,
                tr.first_s if tr.first_s >= 0.0 else None,
                at,
                req.num_prompt_tokens,
                produced,
                req.num_cached_tokens,
                req.num_preemptions,
            )
        )
        last_finish = max(last_finish, at)
        release(rid, at)

    step = 0
    while arrivals or tracks:
        while arrivals and arrivals[0][0] <= clock:
            at, _, sim = heapq.heappop(arrivals)
            req = Request(
                sim.request_id,
                sim.prompt_token_ids,
                max_tokens=sim.output_len,
                priority=sim.priority,
                arrival_time=at,
                cache_salt=sim.cache_salt,
            )
            try:
                sched.add_request(req)
            except (PromptTooLongError, OverloadedError) as exc:
                logger.debug("request %s rejected: %s", sim.request_id, exc)
                num_rejected += 1
                num_done += 1
                records.append(
                    RequestRecord(
                        sim.request_id,
                        sim.session_id,
                        sim.tag,
                        at,
                        None,
                        None,
                        sim.num_prompt_tokens,
                        0,
                        0,
                        0,
                        rejected=True,
                    )
                )
                release(sim.request_id, clock)
                continue
            tracks[sim.request_id] = _Track(sim, req, at, _output_tokens(sim, cfg.seed))
            num_prompt += sim.num_prompt_tokens
        if not tracks:
            if arrivals:
                clock = max(clock, arrivals[0][0])
            continue
        step += 1
        if step > cfg.max_steps:
            raise SimulationLimitError(
                f"the simulation passed max_steps={cfg.max_steps:,} at simulated t={clock:,.1f}s "
                f"with {len(tracks):,} requests unfinished and {len(arrivals):,} yet to arrive; "
                "raise max_steps or simulate fewer requests"
            )

        c0, w0 = cpu_ns(), wall_ns()
        out = sched.schedule()
        w1, c1 = wall_ns(), cpu_ns()
        sched_cpu.append(c1 - c0)
        sched_wall.append(w1 - w0)
        admit_wall.append(sched.last_step.admission_s)
        for rid in out.finished_ids:  # finished by the scheduler itself (pool too small)
            if rid in tracks:
                finish(rid, clock)
        if out.is_empty:
            if out.preempted_ids or out.finished_ids:
                continue  # the state changed; the next step can admit again
            if arrivals and not sched.num_running:
                clock = max(clock, arrivals[0][0])
                continue
            raise InvariantViolation(
                f"the scheduler scheduled nothing at step {out.step} with {len(tracks)} "
                f"requests unfinished ({sched.num_running} running, {sched.num_waiting} waiting)"
            )
        usage = mgr.usage
        dt = cost.step_time(*step_totals(out))
        clock += dt
        sampled: dict[str, list[int]] = {}
        for sr in out.scheduled:
            if sr.is_prefill:
                prefill_computed += sr.num_tokens
            if sr.samples:
                tr = tracks[sr.request_id]
                if sr.num_draft_tokens:
                    toks = _accepted(tr, sr.token_ids[1:])
                    num_drafts += sr.num_draft_tokens
                    num_accepted += len(toks) - 1
                    sampled[sr.request_id] = toks
                else:
                    sampled[sr.request_id] = [tr.output[tr.req.num_output_tokens]]
        c2, w2 = cpu_ns(), wall_ns()
        results = sched.update(out, sampled)
        w3, c3 = wall_ns(), cpu_ns()
        update_cpu.append(c3 - c2)
        update_wall.append(w3 - w2)
        for res in results:
            tr = tracks[res.request_id]
            if tr.first_s < 0.0:
                tr.first_s = clock
                ttft.append(clock - tr.arrival_s)
                ttft_at.append(clock)
                tag_lists(tr.sim.tag)[0].append(clock - tr.arrival_s)
            else:
                itl.append(clock - tr.last_s)
                tag_lists(tr.sim.tag)[1].append(clock - tr.last_s)
            tr.last_s = clock
            if res.finished:
                finish(res.request_id, clock)
            elif spec_k:
                _propose_drafts(tr, spec_k, cfg.draft_acceptance, cfg.seed)
        series_t.append(clock)
        series_usage.append(usage)
        series_running.append(sched.num_running)
        series_waiting.append(sched.num_waiting)
        series_step.append(dt)
        if progress is not None and step % 256 == 0:
            progress(num_done, len(workload), clock)

    if progress is not None:
        progress(num_done, len(workload), clock)
    kv = mgr.stats()
    makespan = max(last_finish - first_arrival, 0.0)
    steps_dt = np.asarray(series_step)
    per_s = 1.0 / makespan if makespan > 0 else 0.0
    return SimReport(
        label=cfg.label,
        workload=workload.name,
        seed=cfg.seed,
        params=cfg.params,
        num_requests=len(workload),
        num_finished=num_done - num_rejected,
        num_truncated=num_truncated,
        num_rejected=num_rejected,
        num_steps=step,
        makespan_s=makespan,
        ttft_s=Percentiles.of(ttft),
        itl_s=Percentiles.of(itl),
        e2e_s=Percentiles.of(e2e),
        tpot_s=Percentiles.of(tpot),
        num_draft_tokens=num_drafts,
        num_accepted_draft_tokens=num_accepted,
        num_prompt_tokens=num_prompt,
        num_output_tokens=num_output,
        num_prefill_tokens_computed=prefill_computed,
        output_tokens_per_s=num_output * per_s,
        total_tokens_per_s=(num_prompt + num_output) * per_s,
        requests_per_s=(num_done - num_rejected) * per_s,
        prefix_hit_rate=kv.prefix.hit_rate,
        prefix_block_hit_rate=kv.prefix.block_hit_rate,
        num_preemptions=sched.num_preemptions,
        peak_usage=max(series_usage, default=0.0),
        mean_usage=(
            float(np.dot(series_usage, steps_dt) / steps_dt.sum()) if steps_dt.sum() > 0 else 0.0
        ),
        peak_running=max(series_running, default=0),
        peak_waiting=max(series_waiting, default=0),
        series=bucket_series(
            cfg.max_series_points,
            series_t,
            series_usage,
            series_running,
            series_waiting,
            series_step,
            ttft_at,
            ttft,
        ),
        records=tuple(records),
        by_tag=summarize_tags(by_tag, records),
        wall=WallTimings(
            total_s=time.perf_counter() - wall0,
            schedule_cpu_us=Percentiles.of(sched_cpu).scaled(1e-3),
            schedule_wall_us=Percentiles.of(sched_wall).scaled(1e-3),
            admission_wall_us=Percentiles.of(admit_wall).scaled(1e6),
            update_cpu_us=Percentiles.of(update_cpu).scaled(1e-3),
            update_wall_us=Percentiles.of(update_wall).scaled(1e-3),
        ),
    )
