"""``extend_decodes`` (one call for a run of plain decodes) against the per-request calls.

Two managers run the same random sequence of requests, forks, commits, frees and preemptions;
for a run of decodes one calls ``extend_decodes(ids, slots)`` and the other, for each id in
order, ``try_extend_slots(rid, 1, slots)`` or else ``try_allocate_slots(rid, 1, slots)``,
stopping at the first both decline. The count, the slots and the whole manager state (block
ids, pending counts, ref counts, free lists, eviction order, claims, events) must be equal. Runs
include unknown, waiting and preempted ids, forked requests (copy-on-write declines) and pools
too small for the next block (allocation declines), and held requests.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.core import KVCacheManager
from pagedkv.errors import PagedKVError
from reference.core_state import make_manager, manager_state, run_prompt

_OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                *("add", "run", "run", "run", "commit", "commit", "fork", "fork"),
                *("free", "preempt", "wait", "hold"),
            ]
        ),
        st.integers(0, 7),
    ),
    min_size=1,
    max_size=70,
)


def _per_request(m: KVCacheManager, ids: list[str], slots: list[int]) -> int:
    """What ``extend_decodes`` stands for: the scheduler's per-request pair, in order."""
    k = 0
    for rid in ids:
        if (
            m.try_extend_slots(rid, 1, slots) is None
            and m.try_allocate_slots(rid, 1, slots) is None
        ):
            return k
        k += 1
    return k


def _commit_all(managers: tuple[KVCacheManager, ...], live: list[str], salt: int) -> None:
    """Commit every scheduled position (a sampled token each) in both managers."""
    for rid in live:
        n = managers[0]._seqs[rid].num_pending
        if n:
            toks = [(salt + 3 * i) % 13 for i in range(n)]
            for m in managers:
                m.append_tokens(rid, toks)
                m.commit(rid, n)


@settings(max_examples=150, deadline=None)
@given(
    ops=_OPS, caching=st.booleans(), num_blocks=st.integers(4, 16), bs=st.sampled_from([1, 2, 4])
)
def test_extend_decodes_equals_the_per_request_calls(
    ops: list[tuple[str, int]], caching: bool, num_blocks: int, bs: int
) -> None:
    kw = {"num_blocks": num_blocks, "enable_prefix_caching": caching, "enable_events": True}
    batch, single = make_manager(bs, **kw), make_manager(bs, **kw)
    both = (batch, single)
    live: list[str] = []  # added and not freed (started, waiting or preempted)
    counter = 0
    for op, k in ops:
        if op in ("add", "wait") or not live:
            rid = f"r{counter}"
            counter += 1
            prompt = [(7 * k + i) % 11 for i in range(2 + k)]  # shared prefixes across requests
            try:
                for m in both:
                    if op == "wait":
                        m.add_request(rid, prompt, max_tokens=12)  # never started
                    else:
                        run_prompt(m, rid, prompt, max_tokens=12)
            except PagedKVError:
                for m in both:
                    if rid in m._seqs:
                        m.free(rid)
                continue
            live.append(rid)
            continue
        rid = live[k % len(live)]
        seq = batch._seqs[rid]
        if op == "run":
            # a run from k on, wrapping, maybe with an unknown id in it
            ids = (live[k % len(live) :] + live[: k % len(live)])[: 1 + k]
            if k == 7:
                ids.insert(len(ids) // 2, "nobody")
            slots_b, slots_s = [-1], [-1]
            n_b = batch.extend_decodes(ids, slots_b)
            n_s = _per_request(single, ids, slots_s)
            assert n_b == n_s
            assert slots_b == slots_s
            assert len(slots_b) == 1 + n_b  # one slot a request extended
        elif op == "commit":
            _commit_all(both, live, k)
        elif op == "fork" and seq.started and not seq.num_pending and not seq.held:
            child = f"r{counter}"
            counter += 1
            for m in both:
                m.fork(rid, child)
            live.append(child)
        elif op == "free":
            for m in both:
                if m._seqs[rid].held:
                    m.release(rid)
                else:
                    m.free(rid)
            live.remove(rid)
        elif op == "hold" and seq.started and not seq.num_pending and not seq.held:
            for m in both:
                m.hold(rid)
        elif op == "preempt" and seq.started and not seq.held:
            for m in both:
                m.preempt(rid)
        assert manager_state(batch) == manager_state(single)
        batch.check_invariants()


def test_extend_decodes_stops_at_the_first_request_needing_the_general_path() -> None:
    m = make_manager(num_blocks=5)  # 4 usable blocks of 4 (block 0 is the null block)
    run_prompt(m, "a", [1, 2, 3])  # room left in its block
    run_prompt(m, "b", [5, 6, 7, 8])  # its next position needs a new block (the last free one)
    run_prompt(m, "c", [9, 10, 11, 12])  # so does this one's: none is left
    before_c = manager_state(m)["requests"]["c"]
    slots: list[int] = []
    assert m.extend_decodes(["a", "b", "c", "a"], slots) == 2
    table_a, table_b = m.block_ids("a"), m.block_ids("b")
    assert slots == [table_a[0] * 4 + 3, table_b[1] * 4]
    assert manager_state(m)["requests"]["c"] == before_c  # the one declined: unchanged
    assert m.extend_decodes([], slots) == 0
    m.check_invariants()
