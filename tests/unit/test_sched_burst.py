"""A burst of requests sharing a prefix, admitted together, computes the prefix once.

The waiting head whose next block is being computed by a request holding blocks (in flight)
waits for that block's commit and then hits it, so no block is computed twice. Hits are only
ever taken on committed blocks, so the shadow KV's content check (``reference.sched_reference``:
every read of a block table returns exactly the request's history) holds throughout, with
chunked prefill, preemption and an abort of the leader mid-prefill.
"""

from __future__ import annotations

from pagedkv.core import CacheConfig, ReservationPolicy
from pagedkv.sched import Scheduler, SchedulerConfig
from reference.sched_reference import Driver

BS = 4


def make_driver(
    *, budget: int = 256, num_blocks: int = 256, max_num_seqs: int = 32, max_model_len: int = 256
) -> Driver:
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        check_invariants=True,
    )
    cache = CacheConfig(
        block_size=BS, num_blocks=num_blocks, reservation=ReservationPolicy.NONE, watermark=0
    )
    return Driver(Scheduler(cfg, cache))


def prefill_tokens(d: Driver) -> int:
    """Prompt positions computed so far, over every step (a prompt's last token may ride in a
    decode entry after a chunked prefill, so positions are counted, not entry kinds)."""
    total = 0
    for out in d.history:
        for sr in out.scheduled:
            num_prompt = d.prompt_lengths[sr.request_id]
            total += max(0, min(sr.start_position + sr.num_tokens, num_prompt) - sr.start_position)
    return total


SYSTEM = [(7 * i + 3) % 97 for i in range(32)]  # 8 full blocks shared by everyone


def test_identical_burst_computes_the_shared_prompt_once() -> None:
    d = make_driver()
    n = 8
    prompt = [*SYSTEM, 5]  # 33 tokens: 8 full blocks + 1
    for i in range(n):
        d.add(f"r{i}", prompt, max_tokens=4)
    d.run()
    d.assert_outputs_match()
    # the leader computes 33 positions; each follower hits 8 blocks and computes 1 token
    assert prefill_tokens(d) == len(prompt) + (n - 1) * 1
    assert [d.num_cached[f"r{i}"] for i in range(n)] == [0] + [32] * (n - 1)
    d.assert_no_leaks()


def test_overlapping_burst_computes_each_distinct_block_once() -> None:
    """Prompts sharing 2, 4, 6 and 8 blocks of SYSTEM, each with its own 1-token tail."""
    d = make_driver()
    prompts = {f"o{k}": [*SYSTEM[: k * BS], 90 + k] for k in (8, 2, 6, 4)}
    for rid, p in prompts.items():
        d.add(rid, p, max_tokens=3)
    d.run()
    d.assert_outputs_match()
    distinct_blocks = 8  # the longest overlap covers every shared block
    assert prefill_tokens(d) == distinct_blocks * BS + len(prompts)
    assert d.sched.manager.stats().num_duplicate_commits == 0


def test_burst_under_chunked_prefill_waits_for_every_chunk() -> None:
    """The leader's prompt spans 4 chunks; followers wait for its blocks, never recompute."""
    d = make_driver(budget=16, max_num_seqs=8)
    prompt = [*SYSTEM, *SYSTEM[:8], 1]  # 41 tokens: 10 full blocks + 1
    for i in range(4):
        d.add(f"c{i}", prompt, max_tokens=3)
    d.run()
    d.assert_outputs_match()
    assert prefill_tokens(d) == len(prompt) + 3
    assert d.sched.manager.stats().num_duplicate_commits == 0


def test_leader_aborted_mid_prefill_hands_the_prefix_to_a_follower() -> None:
    d = make_driver(budget=16, max_num_seqs=8)
    prompt = [*SYSTEM, 2]
    for i in range(3):
        d.add(f"a{i}", prompt, max_tokens=3)
    d.step()  # a0 computes its first chunk (4 blocks); a1, a2 wait
    assert d.sched.num_running == 1
    d.abort("a0")
    d.run()
    d.assert_outputs_match(["a1", "a2"])
    # a1 reuses a0's 4 committed blocks and computes the rest once; a2 hits all 8
    assert d.num_cached["a1"] == 16
    assert d.num_cached["a2"] == 32
    assert prefill_tokens(d) == 16 + (len(prompt) - 16) + 1
    d.assert_no_leaks()


def test_preempted_leader_releases_its_followers() -> None:
    """With the leader preempted mid-prefill, a follower is no longer held; nothing deadlocks
    and every output is what an unpressured run produces."""
    d = make_driver(budget=8, num_blocks=14, max_num_seqs=4, max_model_len=64)
    prompt = [*SYSTEM[:24], 3]  # 25 tokens: 7 blocks of 12 usable... leader grows, preempts
    d.add("p0", prompt, max_tokens=20)
    d.add("p1", prompt, max_tokens=20)
    d.add("p2", [*SYSTEM[:8], 4], max_tokens=30)
    d.run()
    d.assert_outputs_match()
    d.assert_no_leaks()


def test_same_step_burst_without_prefix_caching_is_admitted_at_once() -> None:
    cfg = SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=128)
    cache = CacheConfig(block_size=BS, num_blocks=128, enable_prefix_caching=False, watermark=0)
    d = Driver(Scheduler(cfg, cache))
    for i in range(4):
        d.add(f"n{i}", [*SYSTEM, 1], max_tokens=2)
    out, _ = d.step()
    assert len(out.scheduled) == 4  # nothing is in flight without prefix caching
    d.run()
    d.assert_outputs_match()
