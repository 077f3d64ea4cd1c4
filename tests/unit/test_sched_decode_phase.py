"""Phase 1 of a step (the running decodes): records made for a run of plain decodes at once
are the records the constructor makes, and a step mixing plain decodes with requests that take
a new block keeps serving order and each request's own slots."""

from __future__ import annotations

import numpy as np

from pagedkv.core import CacheConfig
from pagedkv.sched import Request, Scheduler, SchedulerConfig
from pagedkv.sched.output import RequestOutput, ScheduledRequest, StepSlots, decode_entries

_FIELDS = (
    "request_id",
    "start_position",
    "token_ids",
    "num_tokens",
    "block_table",
    "is_prefill",
    "samples",
    "num_draft_tokens",
)


def test_decode_entries_equal_the_constructor() -> None:
    slots = StepSlots()
    slots.slots.extend([40, 41, 7, 8, 9])
    tables = [np.array([1, 2], dtype=np.int32), np.array([3], dtype=np.int32)]
    made = decode_entries(["a", "b"], [5, 9], [11, 12], tables, slots, 3)
    built = [
        ScheduledRequest("a", 5, [11], 1, tables[0], slots, False, True, 0, 3),
        ScheduledRequest("b", 9, [12], 1, tables[1], slots, False, True, 0, 4),
    ]
    for m, b in zip(made, built, strict=True):
        for name in _FIELDS:
            assert getattr(m, name) is getattr(b, name) or getattr(m, name) == getattr(b, name)
        assert m.slot_mapping.tolist() == b.slot_mapping.tolist()
    assert [m.slot_mapping.tolist() for m in made] == [[8], [9]]


def test_a_decode_step_crossing_block_boundaries_keeps_order_and_slots() -> None:
    """Block size 4; prompts of 3, 4 and 5 tokens: after prefill, request 1 needs a new block
    for its next position while 0 and 2 fit theirs, so one step mixes both paths."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, check_invariants=True
        ),
        CacheConfig(block_size=4, num_blocks=32, watermark=0.0),
    )
    for i, n in enumerate((3, 4, 5)):
        sched.add_request(Request(f"r{i}", [100 * i + t for t in range(n)], max_tokens=8))
    num_new_blocks = 0
    for _ in range(6):
        before = sum(len(sched.manager.block_ids(f"r{i}")) for i in range(3))
        out = sched.schedule()
        num_new_blocks += sum(len(sched.manager.block_ids(f"r{i}")) for i in range(3)) - before
        assert [sr.request_id for sr in out.scheduled] == ["r0", "r1", "r2"]
        offset = 0
        for sr in out.scheduled:
            mgr = sched.manager
            start = sr.start_position
            expect = mgr.slot_mapping(sr.request_id, start, start + sr.num_tokens).tolist()
            assert sr.slot_mapping.tolist() == expect
            assert sr.block_table.tolist() == mgr.block_ids(sr.request_id)
            offset += sr.num_tokens
        assert offset == out.num_scheduled_tokens
        sched.update(out, {sr.request_id: [7] for sr in out.scheduled if sr.samples})
    # prefill: 1 + 1 + 2 blocks; decode positions 3..7, 4..8 and 5..9 start 1 + 2 + 1 blocks
    assert num_new_blocks == 8


def test_a_run_of_plain_decodes_reports_the_constructors_outputs() -> None:
    """``update``'s outputs for plain decodes that do not finish (made without a constructor
    call) equal ``RequestOutput(...)`` field for field, cached prefix counts included."""
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=64, max_num_seqs=8, max_model_len=64, check_invariants=True
        ),
        CacheConfig(block_size=4, num_blocks=32, watermark=0.0),
    )
    for i, n in enumerate((3, 6)):
        sched.add_request(Request(f"r{i}", list(range(1, n + 1)), max_tokens=10))
    out = sched.schedule()
    sched.update(out, {sr.request_id: [50] for sr in out.scheduled if sr.samples})
    out = sched.schedule()
    got = sched.update(out, {"r0": [51], "r1": [52]})
    assert got == [
        RequestOutput("r0", (51,), False, None, 3, 0),
        RequestOutput("r1", (52,), False, None, 6, 0),
    ]
    assert all(type(o) is RequestOutput for o in got)


def _entries(out: object) -> list[tuple[object, ...]]:
    return [
        (*(np.asarray(getattr(sr, f)).tolist() for f in _FIELDS), sr.slot_mapping.tolist())
        for sr in out.scheduled  # type: ignore[attr-defined]
    ]


def test_block_crossings_in_the_run_equal_the_general_path() -> None:
    """A decode crossing into a new block takes ``try_allocate_slots`` and stays in its run;
    with that path declined (every crossing through ``allocate_slots``, one at a time) the
    same steps give the same entries, slots, tables, copies, preemptions and outputs, and the
    same pool (a small pool without reservation, so crossings also preempt)."""
    from reference.core_state import manager_state

    scheds = []
    for _ in range(2):
        sched = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=48, max_num_seqs=8, max_model_len=96, check_invariants=True
            ),
            CacheConfig(block_size=4, num_blocks=20, watermark=0.0, reservation="none"),
        )
        for i in range(10):
            prompt = [(7 * i + t) % 5 for t in range(3 + 2 * i)]  # shared prefixes
            sched.add_request(Request(f"r{i}", prompt, max_tokens=12 + i))
        scheds.append(sched)
    fast, slow = scheds
    slow.manager.try_allocate_slots = lambda *args: None  # type: ignore[method-assign]
    num_crossings = num_preempted = 0
    while fast.has_unfinished_requests():
        a, b = fast.schedule(), slow.schedule()
        assert _entries(a) == _entries(b)
        assert (a.block_copies, a.preempted_ids, a.finished_ids) == (
            b.block_copies,
            b.preempted_ids,
            b.finished_ids,
        )
        num_crossings += sum(
            1 for sr in a.scheduled if not sr.is_prefill and sr.start_position % 4 == 0
        )
        num_preempted += len(a.preempted_ids)
        sampled = {sr.request_id: [(sr.start_position * 3) % 5] for sr in a.scheduled if sr.samples}
        assert fast.update(a, sampled) == slow.update(b, sampled)
        assert manager_state(fast.manager) == manager_state(slow.manager)
    assert not slow.has_unfinished_requests()
    assert num_crossings > 10
    assert num_preempted > 0


def test_requests_without_stop_ids_share_one_empty_set_and_stop_ids_still_stop() -> None:
    a, b = Request("a", [1, 2], max_tokens=4), Request("b", [3], max_tokens=4, stop_token_ids=[])
    c = Request("c", [1, 2], max_tokens=4, stop_token_ids=[9])
    assert a.stop_token_ids is b.stop_token_ids  # one hot object read by every decode step
    assert a.stop_token_ids == frozenset()
    assert c.stop_token_ids == frozenset({9})
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64),
        CacheConfig(block_size=4, num_blocks=16),
    )
    for r in (a, c):
        sched.add_request(r)
    out = sched.schedule()
    outputs = sched.update(out, {"a": [9], "c": [9]})
    assert [(o.request_id, o.finished) for o in outputs] == [("a", False), ("c", True)]
    assert a.stop_token_ids == frozenset()  # the shared set is never written
