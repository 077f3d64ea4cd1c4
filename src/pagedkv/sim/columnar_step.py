"""One simulated step through the scheduler's columnar API (``schedule_columnar`` and
``update_columnar``, :mod:`pagedkv.sched.columnar`): the simulator's fast path.

The step is :meth:`~pagedkv.sim.simulator._Run.run_step` with the plain decodes of a step
handled as columns: one list of tokens per run instead of a ``ScheduledRequest``, a sampled
list and a ``RequestOutput`` per request. Everything the report sees is produced in the same
order as there (the scan's totals, the scheduler's state, every first token, gap, finish and
draft), so reports and per-request records are identical with and without this path
(``SimConfig.fast_decodes``; ``tests/unit/test_sim_fast_decodes.py`` compares whole reports,
records included, in-process; ``benchmarks/sim_reports_identical.py`` across 8 CLI configs
and two source trees).

Not used with KV tiers (their write-through reads every entry's hashes, ``_Run.tier_step``).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pagedkv.sched.columnar import DecodeColumns, Segment
from pagedkv.sched.output import RequestOutput, ScheduledRequest
from pagedkv.sched.request import RequestStatus
from pagedkv.sim.tracks import Track, accepted_tokens, propose_drafts

if TYPE_CHECKING:
    from pagedkv.sim.simulator import _Run

_FINISHED = RequestStatus.FINISHED


def run_columnar_step(run: _Run) -> None:
    """``run.run_step()`` through the columnar API (the same effects, in the same order)."""
    sched, rec = run.sched, run.rec
    wall_ns = time.perf_counter_ns
    timed = run.step % run.cfg.cpu_timing_stride == 0
    cpu_ns = time.thread_time_ns  # a ~3 us system call: only on timed steps (-1 on the others)
    c0 = cpu_ns() if timed else -1
    w0 = wall_ns()
    cols = sched.schedule_columnar()
    w1 = wall_ns()
    c1 = cpu_ns() if timed else -1
    out = cols.output
    tracks = run.tracks
    for rid in out.finished_ids:  # finished by the scheduler itself (pool too small)
        if rid in tracks:
            run.finish(rid, run.clock)
    segments = cols.segments
    if not segments and not out.block_loads:
        rec.on_wall(w1 - w0, None, sched.last_admission_s, c1 - c0 if timed else None, None)
        run.idle(out.preempted_ids or out.finished_ids, out.step)
        return
    mgr = sched.manager
    usage = mgr.usage
    allocated = None
    if run.cfg.allocator.is_contiguous:
        allocated = usage + mgr.running_claim_blocks / mgr.pool.capacity_blocks
    start = run.clock
    sampled, columns, run_tracks, empty_slots, totals = scan_columns(run, segments, start)
    dt = run.cfg.cost.step_time(*totals)
    run.clock = clock = start + dt
    c2 = cpu_ns() if timed else -1
    w2 = wall_ns()
    results = sched.update_columnar(cols, columns, sampled)
    w3 = wall_ns()
    c3 = cpu_ns() if timed else -1
    cpu = (c1 - c0, c3 - c2) if timed else (None, None)
    rec.on_wall(w1 - w0, w3 - w2, sched.last_admission_s, *cpu)
    _after_step(run, segments, run_tracks, results, start, clock)
    if rec.touched:
        rec.end_gaps(clock - start)
    counts = (sched.num_running, sched.num_waiting, cols.num_scheduled_requests)
    rec.on_step(clock, dt, usage, allocated, empty_slots, counts)


def scan_columns(
    run: _Run, segments: list[Segment], start: float
) -> tuple[
    dict[str, list[int]], list[list[int]], list[list[Track]], int, tuple[int, int, int, int, int]
]:
    """``run.scan_step`` over segments: the other entries' sampled tokens, each decode run's
    token column and tracks, the empty slots, the cost totals (the same sums; a plain decode
    at position p adds p + 1 to context and pairs, one to decodes and rows)."""
    tracks = run.tracks
    getitem = tracks.__getitem__
    bs = run.block_size
    seed = run.cfg.seed
    sampled: dict[str, list[int]] = {}
    columns: list[list[int]] = []
    run_tracks: list[list[Track]] = []
    empty = prefill = decodes = context = pairs = rows = computed = 0
    decode_ends = num_plain = 0
    for seg in segments:
        if type(seg) is DecodeColumns:
            # A plain decode's request computed its prompt in an earlier step, so its track
            # has started (sched_s >= 0) and holds its outputs.
            trs = list(map(getitem, seg.ids))
            positions = seg.positions
            # its output index: the outputs so far (its position is its last token's)
            toks = [tr.output[p - tr.output_base] for tr, p in zip(trs, positions, strict=True)]
            n = len(trs)
            # a decode at p has end p + 1 and -(p + 1) % bs == bs - 1 - p % bs empty slots
            decode_ends += sum(positions) + n
            empty += n * (bs - 1) - sum(map(bs.__rmod__, positions))
            num_plain += n
            columns.append(toks)
            run_tracks.append(trs)
            continue
        sr: ScheduledRequest = seg  # type: ignore[assignment]
        rid = sr.request_id
        tr = tracks[rid]
        if tr.sched_s < 0.0:
            tr.start(start, seed)
        k = sr.num_draft_tokens
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
                run.num_drafts += k
                run.num_accepted += len(toks) - 1
                sampled[rid] = toks
            else:
                sampled[rid] = [tr.output[tr.req.num_output_tokens]]
    run.prefill_computed += computed
    context += decode_ends
    pairs += decode_ends
    decodes += num_plain
    rows += num_plain
    return sampled, columns, run_tracks, empty, (prefill, decodes, context, pairs, rows)


def _after_step(
    run: _Run,
    segments: list[Segment],
    run_tracks: list[list[Track]],
    results: list[RequestOutput],
    start: float,
    clock: float,
) -> None:
    """``run_step``'s loop over the results, in batch order: first tokens, gaps (a decode in
    consecutive steps counts toward its tag's step gap), finishes, drafts. A plain decode's
    outcome is read from its request (FINISHED: it finished this step)."""
    rec = run.rec
    touched = rec.touched
    spec_k = run.cfg.num_draft_tokens
    tracks = run.tracks
    k = r = 0
    for seg in segments:
        if type(seg) is DecodeColumns:
            for tr in run_tracks[k]:
                if tr.first_s < 0.0:
                    tr.first_s = clock
                    rec.on_first_token(tr.sim.tag, clock, tr.arrival_s)
                elif tr.last_s == start:
                    ts = tr.tag_samples
                    if not ts.pending:
                        touched.append(ts)
                    ts.pending += 1
                else:
                    tr.tag_samples.itl.append(clock - tr.last_s)
                tr.last_s = clock
                if tr.req.status is _FINISHED:
                    run.finish(tr.sim.request_id, clock)
                elif spec_k:
                    propose_drafts(tr, spec_k, run.cfg.draft_acceptance, run.cfg.seed)
            k += 1
            continue
        if r == len(results) or results[r].request_id != seg.request_id:  # type: ignore[union-attr]
            continue  # a prefill chunk that samples nothing
        res = results[r]
        r += 1
        tr = tracks[res.request_id]
        if tr.first_s < 0.0:
            tr.first_s = clock
            rec.on_first_token(tr.sim.tag, clock, tr.arrival_s)
        elif tr.last_s == start:
            ts = tr.tag_samples
            if not ts.pending:
                touched.append(ts)
            ts.pending += 1
        else:
            tr.tag_samples.itl.append(clock - tr.last_s)
        tr.last_s = clock
        if res.finished:
            run.finish(res.request_id, clock)
        elif spec_k:
            propose_drafts(tr, spec_k, run.cfg.draft_acceptance, run.cfg.seed)
