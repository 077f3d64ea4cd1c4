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
A request whose ``max_tokens`` exceeds its output length ends with a stop token at that length
(the output's last token is replaced by it), as a model stops at EOS; the scheduler's own stop
check ends it. ``allocator`` picks paged blocks or a contiguous reservation baseline
(:mod:`pagedkv.sim.allocators`).

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
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pagedkv.core.config import CacheConfig
from pagedkv.errors import (
    InvalidRequestError,
    InvariantViolation,
    OverloadedError,
    PromptTooLongError,
    SimulationLimitError,
)
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sched.output import ScheduledRequest, SchedulerOutput
from pagedkv.sched.request import Request
from pagedkv.sched.scheduler import Scheduler
from pagedkv.sim.allocators import Allocator, reserved_max_tokens
from pagedkv.sim.columnar_step import run_columnar_step
from pagedkv.sim.cost_model import CostModel, StepCost
from pagedkv.sim.recorder import Recorder
from pagedkv.sim.report import SimReport
from pagedkv.sim.roofline import MemoryPool
from pagedkv.sim.tiers import SimTierStack, TierSpec, kv_bytes_per_token_of, tier_reports
from pagedkv.sim.tracks import Track, accepted_tokens, propose_drafts
from pagedkv.sim.workload import (
    EOS_TOKEN_ID,
    SimRequest,
    Workload,
)

logger = logging.getLogger(__name__)

Sampled = dict[str, list[int]]
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
    allocator: Allocator = Allocator.PAGED  # or a contiguous baseline (pagedkv.sim.allocators)
    memory_pool: MemoryPool | None = None  # set when cache.num_blocks was sized from memory
    cpu_timing_stride: int = 4  # CPU-time schedule()/update() every n-th step (a syscall each)
    num_replicas: int = 1  # engines behind a router (pagedkv.sim.replicas)
    router: str = "round-robin"  # a pagedkv.route policy: least-load, cache-aware (_ accepted)
    tiers: tuple[TierSpec, ...] = ()  # KV tiers below the device pool, top first (sim.tiers)
    kv_bytes_per_token: int | None = None  # a tier block's bytes / block_size (None: derived)
    fast_decodes: bool = True  # plain decodes in columns (sim.columnar_step): same results

    def __post_init__(self) -> None:
        if self.seed < 0:
            raise InvalidRequestError(f"seed must be >= 0, got {self.seed}")
        if self.max_series_points < 2:
            raise InvalidRequestError(
                f"max_series_points must be >= 2, got {self.max_series_points}"
            )
        if self.num_replicas <= 0:
            raise InvalidRequestError(f"num_replicas must be positive, got {self.num_replicas}")
        from pagedkv.sim.replicas import router_name  # (it imports this module)

        object.__setattr__(self, "router", router_name(self.router))  # frozen: normalized once
        if self.cpu_timing_stride <= 0:
            raise InvalidRequestError(
                f"cpu_timing_stride must be positive, got {self.cpu_timing_stride}"
            )
        if self.max_steps <= 0:
            raise InvalidRequestError(f"max_steps must be positive, got {self.max_steps}")
        if self.tiers:
            self._check_tiers()
        if self.num_draft_tokens < 0:
            raise InvalidRequestError(f"num_draft_tokens must be >= 0, got {self.num_draft_tokens}")
        if not 0.0 <= self.draft_acceptance <= 1.0:
            raise InvalidRequestError(
                f"draft_acceptance must be in [0, 1], got {self.draft_acceptance}"
            )

    def _check_tiers(self) -> None:
        if self.num_draft_tokens:
            raise InvalidRequestError(
                "KV tiers are not simulated with speculative decoding (spec_k > 0)"
            )
        if self.allocator.is_contiguous:
            raise InvalidRequestError(
                f"KV tiers hold paged prefix blocks; the {self.allocator.value} allocator has none"
            )
        if not self.cache.enable_prefix_caching:
            raise InvalidRequestError(
                "KV tiers hold prefix blocks by hash: they need prefix caching (caching=on)"
            )


def _no_cpu() -> int:
    """Stands in for the CPU clock on steps that are not CPU-timed (their times are None)."""
    return -1


class _Run:
    """One simulation: the scheduler, the virtual clock, the requests in flight (``tracks``)
    and those yet to arrive (a heap, plus followers waiting for the request they follow).

    Invariant: a request id is in at most one of ``arrivals``, ``followers`` (as a child) and
    ``tracks``; ``num_done`` counts those that left all three.
    """

    def __init__(
        self,
        workload: Workload,
        cfg: SimConfig,
        progress: Progress | None,
        *,
        replica_of: _Run | None = None,
    ) -> None:
        """A run over ``workload``; with ``replica_of``, one more replica of that run: it shares
        its recorder and followers and starts with no arrivals (a router feeds them)."""
        self.cfg = cfg
        self.workload = workload
        self.progress = progress
        self.tier_stack: SimTierStack | None = None
        if cfg.tiers:
            per_token = kv_bytes_per_token_of(cfg.cost, cfg.kv_bytes_per_token)
            self.tier_stack = SimTierStack(cfg.tiers, cfg.cache.block_size, per_token, cfg.cost)
        self.sched = Scheduler(cfg.scheduler, cfg.cache, tier_index=self.tier_stack)
        self.arrivals: list[tuple[float, int, SimRequest]] = []  # heap of (time, order, request)
        self.released = self.arrivals  # where followers go when released (replicas: the router)
        self.rec: Recorder
        self.followers: dict[str, list[tuple[int, SimRequest]]]  # (order, child) by parent id
        if replica_of is not None:
            self.rec = replica_of.rec
            self.followers = replica_of.followers  # shared: a child is released once, anywhere
        else:
            self.rec = Recorder(workload.requests)
            self.followers = {}
            for order, r in enumerate(workload.requests):
                if r.follows is None:
                    self.arrivals.append((r.arrival_s, order, r))
                else:
                    self.followers.setdefault(r.follows, []).append((order, r))
            heapq.heapify(self.arrivals)
        self.tracks: dict[str, Track] = {}
        self.num_done = self.num_rejected = self.num_truncated = 0
        self.num_prompt = self.num_output = self.prefill_computed = 0
        self.num_drafts = self.num_accepted = 0
        first = workload.requests[0].arrival_s if workload.requests else 0.0
        self.first_arrival = self.clock = self.last_finish = first
        self.step = 0
        pool = self.sched.manager.pool
        self.capacity_tokens = pool.capacity_blocks * cfg.cache.block_size
        self.rec.capacity_tokens = self.capacity_tokens
        self.max_len = cfg.scheduler.max_model_len
        self.block_size = cfg.cache.block_size
        # the columnar step (identical results); tiers read every entry's hashes (tier_step)
        self.columnar = cfg.fast_decodes and self.tier_stack is None

    # -------------------------------------------------------------- arrivals and finishes
    def release(self, rid: str, at: float) -> None:
        for order, child in self.followers.pop(rid, ()):
            when = max(child.arrival_s, at + child.think_s)
            heapq.heappush(self.released, (when, order, child))

    def admit_arrivals(self) -> None:
        """Add every request whose arrival time has come (rejections are counted, not raised)."""
        arrivals, cfg = self.arrivals, self.cfg
        while arrivals and arrivals[0][0] <= self.clock:
            at, order, sim = heapq.heappop(arrivals)
            limit = sim.max_tokens_limit
            if cfg.allocator.is_contiguous:
                limit = reserved_max_tokens(
                    cfg.allocator, sim.num_prompt_tokens, sim.output_len, limit, self.max_len
                )
            stops = limit > sim.output_len
            req = Request(
                sim.request_id,
                sim.prompt_token_ids,
                max_tokens=limit,
                stop_token_ids=(EOS_TOKEN_ID,) if stops else (),
                priority=sim.priority,
                arrival_time=at,
                cache_salt=sim.cache_salt,
            )
            try:
                self.sched.add_request(req)
            except (PromptTooLongError, OverloadedError) as exc:
                logger.debug("request %s rejected: %s", sim.request_id, exc)
                self.reject(sim, order, at)
                continue
            self.tracks[sim.request_id] = Track(sim, order, req, stops, self.rec.tag(sim.tag))
            self.num_prompt += sim.num_prompt_tokens

    def reject(self, sim: SimRequest, order: int, at: float) -> None:
        self.num_rejected += 1
        self.num_done += 1
        self.rec.on_reject(order, at, sim.num_prompt_tokens)
        self.release(sim.request_id, self.clock)

    def finish(self, rid: str, at: float) -> None:
        tr = self.tracks.pop(rid)
        self.num_done += 1
        req = tr.req
        produced = req.num_output_tokens
        self.num_output += produced
        if produced < tr.sim.output_len:
            self.num_truncated += 1
        counts = (req.num_prompt_tokens, produced, req.num_cached_tokens, req.num_preemptions)
        queue = tr.sched_s - tr.arrival_s if tr.sched_s >= 0.0 else -1.0
        times = (tr.arrival_s, tr.first_s, at)
        self.rec.on_finish(tr.order, tr.sim.tag, times, counts, tr.last_s, queue)
        self.last_finish = max(self.last_finish, at)
        self.release(rid, at)

    # ---------------------------------------------------------------------- one step
    def run_step(self) -> None:
        """Schedule, advance the clock by the step's cost, feed the sampled tokens back."""
        if self.columnar:
            run_columnar_step(self)
            return
        sched, tracks, rec = self.sched, self.tracks, self.rec
        wall_ns = time.perf_counter_ns
        # the thread CPU clock is a ~3 µs system call: sampled every cpu_timing_stride steps
        timed = self.step % self.cfg.cpu_timing_stride == 0
        cpu_ns = time.thread_time_ns if timed else _no_cpu
        c0, w0 = cpu_ns(), wall_ns()
        out = sched.schedule()
        w1, c1 = wall_ns(), cpu_ns()
        for rid in out.finished_ids:  # finished by the scheduler itself (pool too small)
            if rid in tracks:
                self.finish(rid, self.clock)
        if out.is_empty and not out.block_loads:
            rec.on_wall(
                w1 - w0, None, sched.last_step.admission_s, c1 - c0 if timed else None, None
            )
            self.idle(out.preempted_ids or out.finished_ids, out.step)
            return
        mgr = sched.manager
        usage = mgr.usage
        allocated = None  # the used blocks: usage
        if self.cfg.allocator.is_contiguous:
            allocated = usage + mgr.running_claim_blocks / mgr.pool.capacity_blocks
        load_s = 0.0 if self.tier_stack is None else self.tier_step(out)
        start = self.clock
        sampled, empty_slots, totals = self.scan_step(out.scheduled, start)
        dt = self.cfg.cost.step_time(*totals) + load_s
        self.clock = clock = start + dt
        c2, w2 = cpu_ns(), wall_ns()
        results = sched.update(out, sampled)
        w3, c3 = wall_ns(), cpu_ns()
        cpu = (c1 - c0, c3 - c2) if timed else (None, None)
        rec.on_wall(w1 - w0, w3 - w2, sched.last_step.admission_s, *cpu)
        spec_k = self.cfg.num_draft_tokens
        touched = rec.touched
        for res in results:
            tr = tracks[res.request_id]
            if tr.first_s < 0.0:
                tr.first_s = clock
                rec.on_first_token(tr.sim.tag, clock, tr.arrival_s)
            elif tr.last_s == start:  # it decoded in the step before: its gap is this step
                ts = tr.tag_samples
                if not ts.pending:
                    touched.append(ts)
                ts.pending += 1
            else:  # Recorder.on_token, inlined
                tr.tag_samples.itl.append(clock - tr.last_s)
            tr.last_s = clock
            if res.finished:
                self.finish(res.request_id, clock)
            elif spec_k:
                propose_drafts(tr, spec_k, self.cfg.draft_acceptance, self.cfg.seed)
        if touched:
            rec.end_gaps(clock - start)
        counts = (sched.num_running, sched.num_waiting, len(out.scheduled))
        rec.on_step(clock, dt, usage, allocated, empty_slots, counts)

    def scan_step(
        self, scheduled: Iterable[ScheduledRequest], start: float
    ) -> tuple[Sampled, int, tuple[int, int, int, int, int]]:
        """One pass over the step's requests: the token(s) each sampling request gets, the
        empty slots in their last blocks (internal fragmentation), and the step's cost totals
        (exactly :func:`~pagedkv.sim.cost_model.step_totals`, computed in the same pass);
        marks first-scheduled times."""
        tracks = self.tracks
        sampled: Sampled = {}
        bs = self.block_size
        seed = self.cfg.seed
        empty = prefill = decodes = context = pairs = rows = computed = 0
        # A plain decode (one position p, sampled) adds p + 1 to context and to pairs, and one
        # to decodes and to rows: summed once after the loop (the general branch's totals).
        decode_ends = num_plain = 0
        for sr in scheduled:
            rid = sr.request_id
            tr = tracks[rid]
            if tr.sched_s < 0.0:
                tr.start(start, seed)
            k = sr.num_draft_tokens
            if not k and sr.samples and not sr.is_prefill:  # a plain decode: one token
                end = sr.start_position + 1
                empty += -end % bs
                decode_ends += end
                num_plain += 1
                # its output index: the outputs so far (its position is its last token's)
                sampled[rid] = [tr.output[end - tr.num_prompt_tokens]]
                continue
            pos = sr.start_position
            n = sr.num_tokens
            end = pos + n
            empty += -end % bs
            context += end
            pairs += n * pos + n * (n + 1) // 2
            if sr.is_prefill:
                prefill += n
                computed += n
            else:
                decodes += 1
                prefill += k
                rows += k
            if sr.samples:
                rows += 1
                if k:
                    toks = accepted_tokens(tr, sr.token_ids[1:])
                    self.num_drafts += k
                    self.num_accepted += len(toks) - 1
                    sampled[rid] = toks
                else:
                    sampled[rid] = [tr.output[tr.req.num_output_tokens]]
        self.prefill_computed += computed
        context += decode_ends
        pairs += decode_ends
        decodes += num_plain
        rows += num_plain
        return sampled, empty, (prefill, decodes, context, pairs, rows)

    def tier_step(self, out: SchedulerOutput) -> float:
        """The step's tier work: apply its loads (returning their seconds), write through the
        blocks it computes, count held blocks that first-scheduled requests recompute."""
        stack = self.tier_stack
        assert stack is not None
        mgr = self.sched.manager
        load_s = 0.0
        if out.block_loads:
            owner = {b: rid for rid in out.loading_ids for b in mgr.block_ids_view(rid)}
            load_s = stack.load_time_s(out, owner)
        bs = self.block_size
        tracks = self.tracks
        for sr in out.scheduled:
            hashes = mgr.block_hashes(sr.request_id)
            first = sr.start_position // bs
            if sr.is_prefill and tracks[sr.request_id].sched_s < 0.0:
                last = (tracks[sr.request_id].req.num_tokens - 1) // bs
                stack.note_skips(hashes[:last], first)
            stack.store(hashes[first : (sr.start_position + sr.num_tokens) // bs])
        return load_s

    def idle(self, changed: object, step: int) -> None:
        """An empty step: the state changed, or the clock jumps to the next arrival."""
        if changed:
            return  # the next step can admit again
        if self.arrivals and not self.sched.num_running:
            self.clock = max(self.clock, self.arrivals[0][0])
            return
        raise InvariantViolation(
            f"the scheduler scheduled nothing at step {step} with {len(self.tracks)} "
            f"requests unfinished ({self.sched.num_running} running, "
            f"{self.sched.num_waiting} waiting)"
        )

    # ---------------------------------------------------------------------- the loop
    def next_event_s(self) -> float:
        """When this run next acts: now if it holds requests, else its next arrival."""
        if self.tracks:
            return self.clock
        return self.arrivals[0][0] if self.arrivals else math.inf

    def advance(self) -> None:
        """Admit what has arrived, then run one step (or jump the clock to the next arrival)."""
        self.admit_arrivals()
        if not self.tracks:
            if self.arrivals:
                self.clock = max(self.clock, self.arrivals[0][0])
            return
        self.step += 1
        cfg = self.cfg
        if self.step > cfg.max_steps:
            raise SimulationLimitError(
                f"the simulation passed max_steps={cfg.max_steps:,} at simulated "
                f"t={self.clock:,.1f}s with {len(self.tracks):,} requests unfinished and "
                f"{len(self.arrivals):,} yet to arrive; raise max_steps or simulate fewer "
                "requests"
            )
        self.run_step()
        if self.progress is not None and self.step % 256 == 0:
            self.progress(self.num_done, len(self.workload), self.clock)

    def run(self) -> SimReport:
        wall0 = time.perf_counter()
        while self.arrivals or self.tracks:
            self.advance()
        if self.progress is not None:
            self.progress(self.num_done, len(self.workload), self.clock)
        return build_report([self], time.perf_counter() - wall0)


def build_report(runs: list[_Run], wall_s: float, **routing: Any) -> SimReport:
    """The report of one run, or of replicas sharing one recorder (counters summed);
    ``routing``: the replicas' routing fields of the report."""
    head = runs[0]
    cfg = head.cfg
    snaps = [r.sched.manager.stats().prefix for r in runs]
    query_tokens = sum(p.query_tokens for p in snaps)
    query_blocks = sum(p.cacheable_query_blocks for p in snaps)
    first = min(r.first_arrival for r in runs)
    makespan = max(max(r.last_finish for r in runs) - first, 0.0)
    per_s = 1.0 / makespan if makespan > 0 else 0.0
    rejected = sum(r.num_rejected for r in runs)
    finished = sum(r.num_done for r in runs) - rejected
    prompt = sum(r.num_prompt for r in runs)
    output = sum(r.num_output for r in runs)
    return head.rec.build(
        cfg.max_series_points,
        label=cfg.label,
        workload=head.workload.name,
        seed=cfg.seed,
        params=cfg.params,
        num_requests=len(head.workload),
        num_finished=finished,
        num_truncated=sum(r.num_truncated for r in runs),
        num_rejected=rejected,
        num_steps=sum(r.step for r in runs),  # schedule() calls, idle ones included
        makespan_s=makespan,
        num_draft_tokens=sum(r.num_drafts for r in runs),
        num_accepted_draft_tokens=sum(r.num_accepted for r in runs),
        num_prompt_tokens=prompt,
        num_output_tokens=output,
        num_prefill_tokens_computed=sum(r.prefill_computed for r in runs),
        output_tokens_per_s=output * per_s,
        total_tokens_per_s=(prompt + output) * per_s,
        requests_per_s=finished * per_s,
        prefix_hit_rate=sum(p.hit_tokens for p in snaps) / query_tokens if query_tokens else 0.0,
        prefix_block_hit_rate=(
            sum(p.hit_blocks for p in snaps) / query_blocks if query_blocks else 0.0
        ),
        num_preemptions=sum(r.sched.num_preemptions for r in runs),
        kv_capacity_tokens=sum(r.capacity_tokens for r in runs),
        allocator=cfg.allocator.value,
        tiers=tier_reports([r.tier_stack for r in runs if r.tier_stack is not None], query_blocks),
        wall=head.rec.wall_timings(wall_s),
        **routing,
    )


def simulate(
    workload: Workload, config: SimConfig | None = None, *, progress: Progress | None = None
) -> SimReport:
    """Run ``workload`` through a fresh scheduler built from ``config`` and report what happened.

    Raises SimulationLimitError when ``config.max_steps`` steps pass with requests left (a limit
    the caller chose), InvariantViolation if the scheduler stops making progress (a bug).
    """
    cfg = config or SimConfig()
    if cfg.num_replicas > 1:
        from pagedkv.sim.replicas import simulate_replicas

        return simulate_replicas(workload, cfg, progress)
    return _Run(workload, cfg, progress).run()
