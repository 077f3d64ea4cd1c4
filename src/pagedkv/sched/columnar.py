"""A scheduler step in columns, for a caller that reads no slot mappings, tables or per-request
outputs of plain decodes (the simulator): ``schedule_columnar`` and ``update_columnar``.

``schedule()``/``update()`` make a ``ScheduledRequest`` for every plain decode (one position,
no drafts, no lookahead) and a ``RequestOutput`` for every sampled token: at ~35 decodes a
step, most of a simulated step's bookkeeping. Here a run of plain decodes stays three columns
(:class:`DecodeColumns`: ids, positions, requests), its sampled tokens come back as one list,
and it reports no record: the caller reads the requests themselves (a member that finished is
``FINISHED``). Everything else (drafts, prefill chunks, admissions, preemption, copies, loads)
is the same ``ScheduledRequest`` as ``schedule()`` makes.

Equivalence (the point): every manager call is the one ``schedule()``/``update()`` make, with
the same arguments in the same order (phase 1 is ``_schedule_decodes`` with its runs kept as
columns, a stretch of plain decodes handed to the manager in one ``extend_decodes`` call, which
is the per-request ``try_extend_slots``/``try_allocate_slots`` pair in order; phases 2-4 are
shared; a commit run breaks where ``update``'s does), so the manager,
the pool, the queues and every request end each step in the same state.
``tests/property/test_sched_columnar.py`` steps both APIs side by side on random workloads and
compares the whole state after every step.

A part of :class:`~pagedkv.sched.scheduler.Scheduler` (a mixin over its state).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedkv.errors import InvalidRequestError, SchedulerStateError
from pagedkv.sched.output import RequestOutput, ScheduledRequest, SchedulerOutput, StepSlots
from pagedkv.sched.preemption import PreemptionMixin
from pagedkv.sched.request import Request, RequestStatus
from pagedkv.sched.step_plan import StepPlan
from pagedkv.sched.step_update import _check_sampled

_MAX_TOKEN_ID = 2**32
_RUNNING = RequestStatus.RUNNING

# A run of plain decodes to commit in one manager call: ids, sampled tokens, requests.
_Run = tuple[list[str], list[int], list[Request]]
# Any other work, after the run before it: the request, its entry, its tokens (None: it only
# commits) and whether the caller gets its RequestOutput (False: a plain decode's).
_Item = tuple[_Run, Request, ScheduledRequest, Sequence[int] | None, bool]


class DecodeColumns:
    """A run of plain decodes, in serving order: request ``ids[k]`` (``requests[k]``) computes
    position ``positions[k]`` (its last token's), its slot appended to the step's slots and
    its block table grown exactly as ``schedule()`` does for it."""

    __slots__ = ("ids", "positions", "requests")

    def __init__(self) -> None:
        self.ids: list[str] = []
        self.positions: list[int] = []
        self.requests: list[Request] = []


Segment = ScheduledRequest | DecodeColumns


@dataclass(slots=True)
class ColumnarOutput:
    """A step in columns. ``segments`` is the step's batch in ``schedule()``'s order (decodes
    first), plain decodes as :class:`DecodeColumns`; ``output`` carries the rest of what
    ``schedule()`` returns (copies, preempted, finished, loads, loading ids, the token count),
    its ``scheduled`` only the ``ScheduledRequest`` segments. A prefill chunk's entry holds
    its positions and flags only (``token_ids``, ``block_table`` and ``slot_mapping`` empty);
    a decode's with drafts is complete. Not for a model runner."""

    output: SchedulerOutput
    segments: list[Segment]
    num_plain_decodes: int  # sum of len(run.ids) over the DecodeColumns segments

    @property
    def num_scheduled_requests(self) -> int:
        return len(self.output.scheduled) + self.num_plain_decodes

    def request_ids(self) -> list[str]:
        """Every scheduled request's id, in batch order."""
        ids: list[str] = []
        for seg in self.segments:
            if type(seg) is DecodeColumns:
                ids.extend(seg.ids)
            else:
                ids.append(seg.request_id)  # type: ignore[union-attr]
        return ids


@dataclass(slots=True, init=False)
class _ColumnarPlan(StepPlan):
    """A ``StepPlan`` whose phase 1 keeps runs of plain decodes as columns (lean prefill
    entries). Its ``__init__`` is written out: the generated one, with its default factories,
    cost ~7.6k instructions a step; this one sets every field of both classes."""

    segments: list[Segment] = field(default_factory=list)  # phase 1's, in order
    num_plain: int = 0
    num_phase1_entries: int = 0  # ScheduledRequests phase 1 appended to ``scheduled``

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.scheduled = []
        self.step_slots = StepSlots()
        self.copies = []
        self.preempted = []
        self.loads = []
        self.num_admitted = 0
        self.lean_prefill = True
        self.num_unlisted_slots = 0
        self.segments = []
        self.num_plain = 0
        self.num_phase1_entries = 0

    def scheduled_ids(self) -> set[str]:
        ids = {sr.request_id for sr in self.scheduled}
        for seg in self.segments:
            if type(seg) is DecodeColumns:
                ids.update(seg.ids)
        return ids


def _first_special(reqs: list[Request], toks: Sequence[int], start: int, max_len: int) -> int:
    """The index from ``start`` of the first member that is not a plain decode that keeps
    running (``update``'s inlined ``stop_reason_one``; ``len(reqs)`` if none): not running,
    a bad token id, a stop token, its ``max_tokens``-th output or ``max_model_len``."""
    n = len(reqs)
    rest = toks[start:] if start else toks
    # exact ints in [0, 2**32), checked in C for the whole rest (as commit_decodes does)
    if list(map(type, rest)).count(int) != n - start or (
        rest and (min(rest) < 0 or max(rest) >= _MAX_TOKEN_ID)
    ):
        for j in range(start, n):
            tok = toks[j]
            if type(tok) is not int or not 0 <= tok < _MAX_TOKEN_ID:
                n = j  # the members before it are checked below
                break
    for req, tok in zip(
        reqs[start:n] if start or n < len(reqs) else reqs, rest, strict=False
    ):  # rest may be longer (a bad id cut n)
        num_after = len(req.all_token_ids) + 1
        if (
            req.status is not _RUNNING
            or tok in req.stop_token_ids
            or num_after - req.num_prompt_tokens >= req.max_tokens
            or num_after >= max_len
        ):
            return reqs.index(req, start)  # (requests are distinct: its own index)
    return n


def _extend_plain_decodes(
    extend_decodes: Callable[[list[str], list[int]], int],
    running: list[Request],
    i: int,
    budget: int,
    run: DecodeColumns,
    slots: list[int],
) -> int:
    """The plain decodes (decoding, no drafts) in a row from ``running[i]``, at most
    ``budget`` of them: one manager call (``extend_decodes``) gives as many as fit their
    positions and slots, in order, and they join ``run``. Returns how many (0: ``running[i]``
    is no plain decode, or the manager declined it)."""
    reqs = running[i : i + budget]
    for req in reqs:
        pos = req.num_computed_tokens
        if pos != len(req.all_token_ids) - 1 or pos < req.num_prompt_tokens or req.draft_token_ids:
            del reqs[reqs.index(req) :]  # (requests are distinct: the first is this one)
            break
    if not reqs:
        return 0
    ids = [req.request_id for req in reqs]
    k = extend_decodes(ids, slots)
    if k < len(ids):
        del ids[k:], reqs[k:]
    positions = [req.num_computed_tokens for req in reqs]  # a decode's: its last token's
    if run.ids:
        run.ids += ids
        run.positions += positions
        run.requests += reqs
    else:  # the run's first (most steps: its only) stretch
        run.ids, run.positions, run.requests = ids, positions, reqs
    return k


class ColumnarStepMixin(PreemptionMixin):
    """``schedule_columnar``/``update_columnar`` for ``Scheduler`` (which provides this state
    and the shared phases)."""

    _outstanding_columns: ColumnarOutput | None
    _step: int

    def _check_no_outstanding_step(self) -> None:
        raise NotImplementedError

    def _schedule_prefill_chunks(self, plan: StepPlan) -> None:
        raise NotImplementedError

    def _admit_waiting(self, plan: StepPlan) -> None:
        raise NotImplementedError

    def _build_output(
        self, plan: StepPlan, admission_s: float, num_unlisted: int = 0
    ) -> SchedulerOutput:
        raise NotImplementedError

    def schedule_columnar(self) -> ColumnarOutput:
        """``schedule()`` with its plain decodes in columns (the same state changes).

        Raises SchedulerStateError, changing nothing, while a step waits for its update.
        """
        self._check_no_outstanding_step()
        self._step += 1
        plan = _ColumnarPlan(self.config.max_num_batched_tokens)
        if not self._schedule_decode_columns(plan):
            self._schedule_prefill_chunks(plan)
        t0 = time.perf_counter()
        self._admit_waiting(plan)
        out = self._build_output(plan, time.perf_counter() - t0, plan.num_plain)
        segments = plan.segments
        if len(plan.scheduled) > plan.num_phase1_entries:  # phases 2 and 3, after phase 1
            segments.extend(plan.scheduled[plan.num_phase1_entries :])
        cols = ColumnarOutput(out, segments, plan.num_plain)
        self._outstanding_columns = cols
        if self.config.check_invariants:
            self.check_invariants()
        return cols

    def _schedule_decode_columns(self, plan: _ColumnarPlan) -> bool:
        """``_schedule_decodes`` (phase 1) with each run of plain decodes kept as a
        :class:`DecodeColumns` segment: the same manager calls in the same order (a stretch
        of plain decodes is one ``extend_decodes`` call, which is the per-request
        ``try_extend_slots``/``try_allocate_slots`` pair, in order, up to the first it
        declines; that one takes the general path, as in ``_schedule_decodes``)."""
        mgr = self.manager
        views = mgr.block_table_view
        lookahead, max_len = self.config.num_lookahead_tokens, self.max_len
        running, scheduled, segments = self.running, plan.scheduled, plan.segments
        step_slots = plan.step_slots
        slots = step_slots.slots
        budget = plan.budget
        i = num_prefilling = 0
        run = DecodeColumns()
        while i < len(running) and budget > 0:
            if not lookahead:
                k = _extend_plain_decodes(mgr.extend_decodes, running, i, budget, run, slots)
                i += k
                budget -= k
                if i == len(running) or not budget:
                    break
            req = running[i]  # not a plain decode, or one the manager declined
            all_ids = req.all_token_ids
            pos = req.num_computed_tokens
            if pos != len(all_ids) - 1 or pos < req.num_prompt_tokens:  # prefilling: phase 2
                num_prefilling += 1
                i += 1
                continue
            rid = req.request_id
            drafts = req.draft_token_ids
            if drafts:
                num_out = len(all_ids) - req.num_prompt_tokens
                room = min(budget, req.max_tokens - num_out, max_len - len(all_ids)) - 1
                drafts = drafts[: max(0, room)]
            n = 1 + len(drafts)
            if run.ids:
                segments.append(run)
                plan.num_plain += len(run.ids)
                run = DecodeColumns()
            offset = len(slots)
            table = (
                mgr.try_extend_slots(rid, n, slots)
                if req.draft_token_ids and not lookahead
                else None
            )
            if table is None:
                if not self._allocate_or_preempt(req, n, lookahead, plan):
                    break  # req itself was preempted; everything after it is gone too
                mgr.append_slot_mapping(rid, pos, n, slots)
                table = views(rid)
            tokens = [all_ids[-1], *drafts] if drafts else [all_ids[-1]]
            sr = ScheduledRequest(
                rid, pos, tokens, n, table, step_slots, False, True, n - 1, offset
            )
            scheduled.append(sr)
            segments.append(sr)
            plan.num_phase1_entries += 1
            budget -= n
            i += 1
        if run.ids:
            segments.append(run)
            plan.num_plain += len(run.ids)
        plan.budget = budget
        return not num_prefilling and i == len(running)

    def update_columnar(
        self,
        output: ColumnarOutput,
        decode_tokens: Sequence[Sequence[int]],
        sampled: Mapping[str, Sequence[int]],
        *,
        failed_loads: Collection[str] = (),
    ) -> list[RequestOutput]:
        """``update()`` for a columnar step: ``decode_tokens[k]`` holds the sampled token of
        each member of the k-th :class:`DecodeColumns` segment, ``sampled`` the accepted
        tokens of the other sampling entries. Returns the outputs of those other entries only,
        in batch order; a plain decode reports nothing (its request shows what happened).
        All or nothing, as ``update()``: SchedulerStateError (not the outstanding step) or
        InvalidRequestError (bad tokens, a column of the wrong length) change nothing."""
        if output is not self._outstanding_columns:
            raise SchedulerStateError(
                f"update_columnar() got step {output.output.step}, which is not the "
                "outstanding columnar step"
            )
        items, last_run = self._validate_columns(output, decode_tokens, sampled)
        unknown = set(failed_loads).difference(output.output.loading_ids) if failed_loads else ()
        if unknown:
            raise InvalidRequestError(
                f"failed_loads names {sorted(unknown)}, which step {output.output.step} did "
                "not load"
            )
        self._outstanding_columns = None
        results = self._apply_columns(items, last_run)
        for rid in output.output.loading_ids:
            req_l = self.loading.pop(rid, None)
            if req_l is not None:
                self._finish_load(req_l, success=rid not in failed_loads)
        if self.config.check_invariants:
            self.check_invariants()
        return results

    def _validate_columns(
        self,
        output: ColumnarOutput,
        decode_tokens: Sequence[Sequence[int]],
        sampled: Mapping[str, Sequence[int]],
    ) -> tuple[list[_Item], _Run]:
        """``_validate_update`` over segments: the same runs and items, in the same order."""
        requests, max_len = self.requests, self.max_len
        plain = self.cache_config.sliding_window is None
        items: list[_Item] = []
        ids: list[str] = []
        tokens: list[int] = []
        reqs: list[Request] = []
        k = 0
        for seg in output.segments:
            if type(seg) is not DecodeColumns:
                sr: ScheduledRequest = seg  # type: ignore[assignment]
                req = requests.get(sr.request_id)
                if req is None or req.status is not _RUNNING:
                    continue  # aborted or finished since schedule(): nothing to apply
                toks = sampled.get(sr.request_id) if sr.samples else None
                if sr.samples:
                    _check_sampled(sr, toks)
                items.append(((ids, tokens, reqs), req, sr, toks, True))
                ids, tokens, reqs = [], [], []
                continue
            col = decode_tokens[k]
            k += 1
            if len(col) != len(seg.ids):
                raise InvalidRequestError(
                    f"decode_tokens[{k - 1}] holds {len(col)} tokens for {len(seg.ids)} decodes"
                )
            n = len(seg.ids)
            a = 0  # members [a, j) keep running and join the commit run
            while a < n:
                j = _first_special(seg.requests, col, a, max_len) if plain else a
                if j == n and not a and not ids:  # the whole segment (most steps): its lists
                    ids, tokens, reqs = seg.ids, list(col), seg.requests
                elif j > a:
                    ids = ids + seg.ids[a:j]  # new lists: the commit never changes its inputs
                    tokens = tokens + list(col[a:j])
                    reqs = reqs + seg.requests[a:j]
                if j == n:
                    break
                req = seg.requests[j]
                a = j + 1
                if req.status is not _RUNNING:
                    continue
                entry = self._decode_entry(req, seg.positions[j])
                toks = [col[j]]
                _check_sampled(entry, toks)
                items.append(((ids, tokens, reqs), req, entry, toks, False))
                ids, tokens, reqs = [], [], []
        if k != len(decode_tokens):
            raise InvalidRequestError(
                f"decode_tokens holds {len(decode_tokens)} columns for {k} decode runs"
            )
        return items, (ids, tokens, reqs)

    def _decode_entry(self, req: Request, pos: int) -> ScheduledRequest:
        """The ``ScheduledRequest`` ``schedule()`` made for a plain decode (its slot, read
        from its table, is the one it was given)."""
        rid = req.request_id
        table = self.manager.block_table_view(rid)
        bs = self.block_size
        slot = np.array([int(table[pos // bs]) * bs + pos % bs], dtype=np.int32)
        return ScheduledRequest(rid, pos, [req.all_token_ids[-1]], 1, table, slot, False, True)

    def _apply_columns(self, items: list[_Item], last_run: _Run) -> list[RequestOutput]:
        """``_apply_work`` without the plain decodes' outputs. Validated: cannot fail."""
        windowed = self.cache_config.sliding_window is not None
        results: list[RequestOutput] = []
        for run, req, sr, toks, report in items:
            if run[0]:
                self._commit_columns(run)
            if toks is None:
                self.manager.commit(req.request_id, sr.num_tokens)
                req.num_computed_tokens += sr.num_tokens
                if windowed:
                    self._release_outside_window(req)
                continue
            if sr.num_tokens == 1 and not windowed:  # a plain decode that finishes
                res = self._apply_decode(req, toks[0])
            else:
                res = self._apply_sampled(req, sr, toks, windowed)
            if report:
                results.append(res)
        if last_run[0]:
            self._commit_columns(last_run)
        return results

    def _commit_columns(self, run: _Run) -> None:
        """``_commit_run`` without the outputs: one manager call, then the requests' counts."""
        ids, tokens, reqs = run
        self.manager.commit_decodes(ids, tokens)  # validated: cannot fail
        for req in reqs:
            req.num_computed_tokens += 1  # == the manager's count (S3)
            if req.draft_token_ids:
                req.draft_token_ids = []
