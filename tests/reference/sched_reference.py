"""A naive reference for the scheduler: a fake model that reads its history from a shadow KV
cache, and a checker of everything one step must satisfy.

The fake model is a deterministic function of the token history, ``next = f(history)``, so a
request's output is fixed by its prompt alone (``expected_output``), whatever batching,
chunking, preemption or speculation happened on the way. The model does not take the history
from the request: it *reads it back from the KV slots* of the block table, where earlier steps
wrote it (``ShadowKV``). A wrong block table, slot mapping, prefix hit, copy-on-write or
rollback therefore changes the output, and the read itself checks that every slot holds the
token it should (each slot also stores an id of the whole prefix up to it).

``StepChecker`` checks one step's output against the scheduler's own state and a per-request
record of the positions scheduled since the request's last admission (conservation: each
position is computed exactly once per admission, contiguously, starting at the prefix hit).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pagedkv.sched import (
    FinishReason,
    Request,
    RequestOutput,
    RequestStatus,
    ScheduledRequest,
    Scheduler,
    SchedulerOutput,
)

VOCAB = 97  # a prime, so hashes spread over every token


def next_token(history: Sequence[int]) -> int:
    """The fake model: the next token is a fixed function of the whole history."""
    return hash(tuple(history)) % VOCAB


def _extend_prefix_id(prev: int, token: int) -> int:
    return hash((prev, token))


def expected_output(
    prompt: Sequence[int], max_tokens: int, stop_token_ids: Sequence[int], max_model_len: int
) -> list[int]:
    """The output of an unpressured greedy run: stop token, max_tokens or max_model_len."""
    history = list(prompt)
    out: list[int] = []
    stops = set(stop_token_ids)
    while True:
        tok = next_token(history)
        history.append(tok)
        out.append(tok)
        if tok in stops or len(out) >= max_tokens or len(history) >= max_model_len:
            return out


class ShadowKV:
    """What the paged KV tensors would hold: ``slot -> (token, prefix id)``.

    A slot written at position ``p`` of a history stores the token and an id of the history up
    to and including ``p``; reading positions ``[0, n)`` through a block table checks that
    consecutive slots belong to one history.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, tuple[int, int]] = {}

    def apply_copies(self, copies: Sequence[tuple[int, int]]) -> None:
        bs = self.block_size
        for src, dst in copies:
            for o in range(bs):
                value = self.slots.get(src * bs + o)
                if value is None:
                    self.slots.pop(dst * bs + o, None)
                else:
                    self.slots[dst * bs + o] = value

    def read(self, block_table: Sequence[int] | np.ndarray, n: int) -> tuple[list[int], int]:
        """Tokens at positions ``[0, n)`` and the prefix id after them. Raises AssertionError
        when a slot is empty or belongs to another history."""
        bs = self.block_size
        tokens: list[int] = []
        pid = 0
        for p in range(n):
            slot = int(block_table[p // bs]) * bs + p % bs
            value = self.slots.get(slot)
            if value is None:
                raise AssertionError(f"position {p} (slot {slot}) was never written")
            tok, stored = value
            pid = _extend_prefix_id(pid, tok)
            if stored != pid:
                raise AssertionError(f"position {p} (slot {slot}) holds another history's KV")
            tokens.append(tok)
        return tokens, pid

    def write(self, slots: Sequence[int] | np.ndarray, tokens: Sequence[int], pid: int) -> int:
        for slot, tok in zip(slots, tokens, strict=True):
            pid = _extend_prefix_id(pid, tok)
            self.slots[int(slot)] = (tok, pid)
        return pid


def run_model(sched: Scheduler, out: SchedulerOutput, kv: ShadowKV) -> dict[str, list[int]]:
    """Execute a step with the fake model: read history from the KV, write the new positions,
    verify drafts greedily. Returns the accepted tokens of every sampling request."""
    kv.apply_copies(out.block_copies)
    sampled: dict[str, list[int]] = {}
    for sr in out.scheduled:
        history, pid = kv.read(sr.block_table, sr.start_position)
        known = sched.get_request(sr.request_id).all_token_ids[: sr.start_position]
        assert history == known, f"{sr.request_id}: the KV holds another history"
        kv.write(sr.slot_mapping, sr.token_ids, pid)
        if not sr.samples:
            continue
        k = sr.num_draft_tokens
        inputs = history + list(sr.token_ids)
        base = len(inputs) - k  # logits after the last non-draft input
        accepted: list[int] = []
        for j in range(k + 1):
            pred = next_token(inputs[: base + j])
            accepted.append(pred)
            if j == k or sr.token_ids[len(sr.token_ids) - k + j] != pred:
                break
        sampled[sr.request_id] = accepted
    return sampled


def write_kv(sched: Scheduler, request_id: str, kv: ShadowKV, start: int, end: int) -> None:
    """Play a remote prefill engine or a KV tier: write the request's KV at ``[start, end)``."""
    req = sched.get_request(request_id)
    table = sched.manager.block_ids(request_id)
    _, pid = kv.read(table, start)
    bs = sched.block_size
    slots = [table[p // bs] * bs + p % bs for p in range(start, end)]
    kv.write(slots, req.all_token_ids[start:end], pid)


def write_remote_kv(sched: Scheduler, request_id: str, kv: ShadowKV) -> None:
    """The remote prefill of a RECEIVE request: every uncached prompt position but the last."""
    req = sched.get_request(request_id)
    write_kv(sched, request_id, kv, req.num_cached_tokens, req.num_tokens - 1)


def write_loaded_kv(sched: Scheduler, request_id: str, kv: ShadowKV) -> None:
    """A tier load of a LOADING request: its allocated, not yet committed prefix positions."""
    req = sched.get_request(request_id)
    start = req.num_computed_tokens
    write_kv(sched, request_id, kv, start, start + sched.manager.num_pending_tokens(request_id))


@dataclass(slots=True)
class _Track:
    request: Request
    next_pos: int | None = None  # None: not admitted since its last (re)queue
    num_admissions: int = 0
    scheduled: list[tuple[int, int]] = field(default_factory=list)  # since the last admission


class StepChecker:
    """Checks each step against the scheduler's state and the conservation record."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.tracks: dict[str, _Track] = {}
        self.num_tokens_scheduled = 0
        self.num_steps = 0

    def forget(self, request_id: str) -> None:
        self.tracks.pop(request_id, None)

    def _track(self, request_id: str) -> _Track:
        track = self.tracks.get(request_id)
        if track is None:
            track = self.tracks[request_id] = _Track(self.sched.get_request(request_id))
        return track

    def requeued(self, request_id: str) -> None:
        """The request went back to the waiting queue (preempted, or its remote KV failed)."""
        self._track(request_id).next_pos = None

    def remote_done(self, request_id: str) -> None:
        """A RECEIVE request's KV arrived: every prompt position but the last is computed."""
        track = self._track(request_id)
        track.next_pos = track.request.num_tokens - 1
        track.num_admissions += 1

    def check_schedule(self, out: SchedulerOutput) -> None:
        sched = self.sched
        cfg = sched.config
        bs = sched.block_size
        mgr = sched.manager
        self.num_steps += 1
        for rid in out.preempted_ids:
            self.requeued(rid)
        total = sum(sr.num_tokens for sr in out.scheduled)
        assert total == out.num_scheduled_tokens
        assert total <= cfg.max_num_batched_tokens, (total, cfg.max_num_batched_tokens)
        ids = [sr.request_id for sr in out.scheduled]
        assert len(set(ids)) == len(ids), f"a request scheduled twice in one step: {ids}"
        kinds = [sr.is_prefill for sr in out.scheduled]
        assert kinds == sorted(kinds), "a decode was placed after a prefill chunk"
        active = len(sched.running) + len(sched.loading) + len(sched.remote_waiting)
        assert active <= cfg.max_num_seqs
        all_slots: list[int] = []
        for sr in out.scheduled:
            self._check_entry(sr, bs)
            all_slots.extend(int(s) for s in sr.slot_mapping)
            for s in sr.slot_mapping:  # written blocks are owned by this request alone
                assert mgr.pool.ref_count(int(s) // bs) == 1, f"write into shared block {s // bs}"
        assert len(set(all_slots)) == len(all_slots), "two positions write the same slot"
        self.num_tokens_scheduled += total

    def _check_entry(self, sr: ScheduledRequest, bs: int) -> None:
        sched = self.sched
        rid = sr.request_id
        req = sched.get_request(rid)
        assert req.status is RequestStatus.RUNNING, (rid, req.status)
        table = sched.manager.block_ids(rid)
        assert sr.block_table.dtype == np.int32
        assert sr.slot_mapping.dtype == np.int32
        assert list(sr.block_table) == table
        n, start = sr.num_tokens, sr.start_position
        assert n == len(sr.token_ids) == len(sr.slot_mapping) > 0
        expected = [table[p // bs] * bs + p % bs for p in range(start, start + n)]
        assert list(sr.slot_mapping) == expected, (rid, list(sr.slot_mapping), expected)
        assert start == req.num_computed_tokens
        k = sr.num_draft_tokens
        if sr.is_prefill:
            assert k == 0
            assert start + n <= req.num_tokens - 1 or (sr.samples and start + n == req.num_tokens)
            assert sr.samples == (start + n == req.num_tokens)
            assert sr.token_ids == req.all_token_ids[start : start + n]
        else:
            assert sr.samples
            assert start == req.num_tokens - 1
            assert sr.token_ids[0] == req.all_token_ids[-1]
            assert n == 1 + k
            assert sr.token_ids[1:] == req.draft_token_ids[:k]
        track = self._track(rid)
        if track.next_pos is None:  # first chunk since (re)admission starts at the prefix hit
            assert start % bs == 0, (rid, start)
            assert start == req.num_cached_tokens, (rid, start, req.num_cached_tokens)
            track.num_admissions += 1
            track.scheduled = []
        else:
            assert start == track.next_pos, (rid, start, track.next_pos)
        track.scheduled.append((start, n))
        track.next_pos = start + n

    def check_update(
        self, out: SchedulerOutput, sampled: dict[str, list[int]], results: list[RequestOutput]
    ) -> None:
        accepted = {res.request_id: len(res.new_token_ids) for res in results}
        for sr in out.scheduled:
            track = self.tracks.get(sr.request_id)
            if track is None or not sr.samples or sr.request_id not in accepted:
                continue
            # positions of drafts not kept (rejected, or after a stop token) are rolled back
            rejected = sr.num_draft_tokens - (accepted[sr.request_id] - 1)
            assert track.next_pos is not None
            track.next_pos -= rejected
        for res in results:
            track = self.tracks[res.request_id]
            req_tokens = sampled[res.request_id]
            assert list(res.new_token_ids) == req_tokens[: len(res.new_token_ids)]
            if res.finished:
                # Chunks since admission were contiguous (checked at schedule time) and reach
                # every position but the last token's: each computed exactly once.
                assert track.next_pos == track.request.num_tokens - 1, (
                    res.request_id,
                    track.next_pos,
                    track.request.num_tokens,
                )
                del self.tracks[res.request_id]


def step(
    sched: Scheduler,
    kv: ShadowKV,
    checker: StepChecker | None = None,
    failed_loads: Collection[str] = (),
) -> tuple[SchedulerOutput, list[RequestOutput]]:
    """One full step: schedule, check, run the fake model (and the tier loads, except
    ``failed_loads``), update, check invariants."""
    out = sched.schedule()
    sched.check_invariants()
    if checker is not None:
        checker.check_schedule(out)
    for rid in out.loading_ids:
        if rid not in failed_loads:
            write_loaded_kv(sched, rid, kv)
    sampled = run_model(sched, out, kv)
    results = sched.update(out, sampled, failed_loads=failed_loads)
    sched.check_invariants()
    if checker is not None:
        checker.check_update(out, sampled, results)
    return out, results


class FakeTier:
    """A lower KV tier holding a set of block hashes (the scheduler's ``TierIndex``)."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()

    def contains_prefix(self, block_hashes: Sequence[bytes]) -> int:
        n = 0
        for h in block_hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def add_prompt(self, sched: Scheduler, prompt: Sequence[int]) -> None:
        """Hold the full blocks of ``prompt`` (hashed by the scheduler's own manager)."""
        mgr = sched.manager
        mgr.add_request("__tier_probe__", prompt)
        self.hashes.update(mgr.block_hashes("__tier_probe__"))
        mgr.free("__tier_probe__")


class Driver:
    """A scheduler, its shadow KV and checker, and the expected output of every request.

    ``add`` records the unpressured output of the request; ``step``/``run`` drive the loop
    with the fake model and collect what each request produced.
    """

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.kv = ShadowKV(sched.block_size)
        self.checker = StepChecker(sched)
        self.expected: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finish_reasons: dict[str, FinishReason | None] = {}
        self.num_cached: dict[str, int] = {}
        self.preempted: list[str] = []  # every preemption, in order
        self.history: list[SchedulerOutput] = []
        self.prompt_lengths: dict[str, int] = {}

    def add(self, request_id: str, prompt: Sequence[int], **kwargs: Any) -> Request:
        req = Request(request_id, prompt, **kwargs)
        self.sched.add_request(req)
        self.expected[request_id] = expected_output(
            req.all_token_ids,
            req.max_tokens,
            sorted(req.stop_token_ids),
            self.sched.config.max_model_len,
        )
        self.outputs[request_id] = []
        self.prompt_lengths[request_id] = req.num_prompt_tokens
        return req

    def step(
        self, failed_loads: Collection[str] = ()
    ) -> tuple[SchedulerOutput, list[RequestOutput]]:
        out, results = step(self.sched, self.kv, self.checker, failed_loads)
        self.preempted.extend(out.preempted_ids)
        self.history.append(out)
        for res in results:
            self.outputs[res.request_id].extend(res.new_token_ids)
            if res.finished:
                self.finish_reasons[res.request_id] = res.finish_reason
                self.num_cached[res.request_id] = res.num_cached_tokens
        return out, results

    def run(self, max_steps: int = 10_000) -> int:
        """Step until nothing is unfinished; returns the number of steps. Fails past max_steps
        (a request left waiting forever)."""
        for n in range(max_steps):
            if not self.sched.has_unfinished_requests():
                return n
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def finish_remote_kv(self, request_id: str, *, success: bool) -> None:
        if success:
            write_remote_kv(self.sched, request_id, self.kv)
        self.sched.finish_remote_kv(request_id, success=success)
        self.sched.check_invariants()
        if success:
            self.checker.remote_done(request_id)
        else:
            self.checker.requeued(request_id)

    def abort(self, request_id: str) -> None:
        self.sched.abort(request_id)
        self.sched.check_invariants()
        self.checker.forget(request_id)
        self.finish_reasons[request_id] = FinishReason.ABORT

    def assert_outputs_match(self, request_ids: Sequence[str] | None = None) -> None:
        """Finished requests produced exactly what an unpressured run produces."""
        ids = self.expected if request_ids is None else request_ids
        for rid in ids:
            assert self.outputs[rid] == self.expected[rid], rid

    def assert_no_leaks(self) -> None:
        """Nothing holds a block: the pool is all free (cached-free blocks allowed)."""
        pool = self.sched.manager.pool
        assert pool.num_used_blocks == 0, pool.num_used_blocks
        assert pool.num_free_blocks == pool.capacity_blocks
        assert self.sched.manager.running_claim_blocks == 0
        assert self.sched.manager.num_requests == len(self.sched.requests)
