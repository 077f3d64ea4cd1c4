"""A hypothesis state machine over the scheduler: add / step (with random drafts) / abort /
remote-KV confirmations / send releases, on tiny pools so that preemption happens.

The reference (``reference.sched_reference``) checks, every step: the budget and max_num_seqs,
slots equal to ``block_id * block_size + offset`` of the request's table, no two positions on
one slot, no write into a shared block, the KV read back by the fake model is the request's own
history, and conservation: since its last admission every position of a request is scheduled
exactly once, contiguously from its prefix hit, up to all tokens but the last when it
finishes. ``check_invariants()`` runs after every schedule and update. At teardown everything
is drained: every request finishes, finished outputs equal an unpressured run, and the pool
holds no block (cached-free blocks allowed).
"""

from __future__ import annotations

import os
import random

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.core import CacheConfig, ReservationPolicy
from pagedkv.sched import FinishReason, KVTransfer, Scheduler, SchedulerConfig
from reference.sched_reference import VOCAB, Driver, FakeTier, next_token

MAX_MODEL_LEN = 40
_rng = random.Random(1234)
SHARED_PREFIXES = [[_rng.randrange(VOCAB) for _ in range(24)] for _ in range(3)]


class SchedulerMachine(RuleBasedStateMachine):
    d: Driver

    @initialize(
        block_size=st.sampled_from([2, 4, 8]),
        extra_blocks=st.integers(0, 4),
        reservation=st.sampled_from(["none", "none", "max_tokens"]),
        policy=st.sampled_from(["fcfs", "priority"]),
        budget=st.integers(4, 48),
        max_num_seqs=st.integers(1, 6),
        lookahead=st.integers(0, 2),
        chunked=st.booleans(),
        prefix_caching=st.sampled_from([True, True, True, False]),
        with_tier=st.booleans(),
    )
    def setup(
        self,
        block_size: int,
        extra_blocks: int,
        reservation: str,
        policy: str,
        budget: int,
        max_num_seqs: int,
        lookahead: int,
        chunked: bool,
        prefix_caching: bool,
        with_tier: bool,
    ) -> None:
        # The pool always fits one request of max_model_len alone (drafts and lookahead too).
        alone = -(-(MAX_MODEL_LEN - 1 + lookahead) // block_size)
        cfg = SchedulerConfig(
            max_num_batched_tokens=budget if chunked else max(budget, MAX_MODEL_LEN),
            max_num_seqs=min(max_num_seqs, budget),  # the config requires budget >= max_num_seqs
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=chunked,
            policy=policy,
            num_lookahead_tokens=lookahead,
            check_invariants=True,
        )
        cache = CacheConfig(
            block_size=block_size,
            num_blocks=alone + 1 + extra_blocks,
            reservation=ReservationPolicy(reservation),
            watermark=0.0,
            enable_prefix_caching=prefix_caching,
        )
        self.tier = FakeTier() if with_tier else None
        self.d = Driver(Scheduler(cfg, cache, tier_index=self.tier))
        if self.tier is not None:  # a lower tier holds half of each shared prefix
            for prefix in SHARED_PREFIXES:
                self.tier.add_prompt(self.d.sched, prefix[:12])
        self.num_added = 0
        self.cut: set[str] = set()  # finished by the scheduler itself (outgrew the pool)

    @rule(
        prefix=st.integers(0, len(SHARED_PREFIXES) - 1),
        prefix_len=st.integers(0, 24),
        suffix=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
        max_tokens=st.integers(1, 24),
        stop=st.lists(st.integers(0, VOCAB - 1), max_size=2),
        priority=st.integers(0, 2),
        transfer=st.sampled_from([KVTransfer.NONE] * 4 + [KVTransfer.RECEIVE, KVTransfer.SEND]),
    )
    def add(
        self,
        prefix: int,
        prefix_len: int,
        suffix: list[int],
        max_tokens: int,
        stop: list[int],
        priority: int,
        transfer: KVTransfer,
    ) -> None:
        rid = f"r{self.num_added}"
        self.num_added += 1
        prompt = SHARED_PREFIXES[prefix][:prefix_len] + suffix
        self.d.add(
            rid,
            prompt,
            max_tokens=max_tokens,
            stop_token_ids=stop,
            priority=priority,
            arrival_time=float(self.num_added),
            kv_transfer=transfer,
        )

    @rule(seed=st.integers(0, 2**16), n=st.integers(1, 6))
    def add_batch(self, seed: int, n: int) -> None:
        """Several requests at once (cheaper than n rules): shared prefixes, mixed roles."""
        rng = random.Random(seed)
        for _ in range(n):
            self.add(
                prefix=rng.randrange(len(SHARED_PREFIXES)),
                prefix_len=rng.randrange(25),
                suffix=[rng.randrange(VOCAB) for _ in range(rng.randrange(1, 11))],
                max_tokens=rng.randrange(1, 25),
                stop=[rng.randrange(VOCAB) for _ in range(rng.randrange(3))],
                priority=rng.randrange(3),
                transfer=rng.choice([KVTransfer.NONE] * 6 + [KVTransfer.RECEIVE, KVTransfer.SEND]),
            )

    @rule(data=st.data(), num_steps=st.integers(1, 6))
    def step(self, data: st.DataObject, num_steps: int) -> None:
        for _ in range(num_steps):
            self._step(data)

    def _step(self, data: st.DataObject) -> None:
        for req in self.d.sched.running:
            if req.num_computed_tokens != req.num_tokens - 1:
                continue
            kind = data.draw(st.sampled_from(["none", "none", "true", "random"]))
            if kind == "none":
                continue
            k = data.draw(st.integers(1, 4))
            if kind == "random":
                req.draft_token_ids = data.draw(
                    st.lists(st.integers(0, VOCAB - 1), min_size=k, max_size=k)
                )
                continue
            history = list(req.all_token_ids)
            drafts: list[int] = []
            for _ in range(k):
                history.append(next_token(history))
                drafts.append(history[-1])
            req.draft_token_ids = drafts
        failed: set[str] = set()
        if self.d.sched.loading:
            fail: bool = data.draw(st.booleans())
            if fail:
                failed = set(self.d.sched.loading)  # loads of this step that will fail
        out, _ = self.d.step(failed_loads=failed)
        self._note_cut(out.finished_ids)

    @precondition(lambda self: bool(self.d.sched.requests))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.d.sched.requests)))
        self.d.abort(rid)

    @precondition(lambda self: bool(self.d.sched.remote_waiting))
    @rule(data=st.data(), success=st.booleans())
    def finish_remote_kv(self, data: st.DataObject, success: bool) -> None:
        rid = data.draw(st.sampled_from(sorted(self.d.sched.remote_waiting)))
        self.d.finish_remote_kv(rid, success=success)

    @precondition(lambda self: bool(self.d.sched.sending))
    @rule(data=st.data())
    def finish_kv_send(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(sorted(self.d.sched.sending)))
        self.d.sched.finish_kv_send(rid)
        self.d.sched.check_invariants()

    @invariant()
    def consistent(self) -> None:
        sched = self.d.sched
        sched.check_invariants()
        pool = sched.manager.pool
        assert 0 <= pool.num_used_blocks <= pool.capacity_blocks
        assert sched.manager.num_requests == len(sched.requests)
        stats = sched.stats()
        assert stats.num_scheduled_tokens_total == self.d.checker.num_tokens_scheduled

    def _note_cut(self, finished_ids: list[str]) -> None:
        for rid in finished_ids:
            if rid not in self.d.finish_reasons:
                self.cut.add(rid)  # finished inside schedule(), not by update()

    def teardown(self) -> None:
        d = self.d
        sched = d.sched
        for _ in range(3_000):
            for rid in sorted(sched.remote_waiting):
                d.finish_remote_kv(rid, success=True)
            for rid in sorted(sched.sending):
                sched.finish_kv_send(rid)
            if not sched.has_unfinished_requests():
                break
            out, _ = d.step()
            self._note_cut(out.finished_ids)
        else:
            raise AssertionError("requests left unfinished: a request waits forever")
        for rid in sorted(sched.sending):
            sched.finish_kv_send(rid)
        assert not sched.requests
        d.assert_no_leaks()
        drafts = sum(sr.num_draft_tokens for out in d.history for sr in out.scheduled)
        n = sched.num_preemptions
        event(f"preemptions: {'0' if not n else '1-4' if n < 5 else '5+'}")
        event(f"drafted tokens: {'0' if not drafts else '1+'}")
        event(f"aborted: {'0' if not sched.num_aborted else '1+'}")
        event(f"tier loads: {'0' if not sched.num_loaded_blocks else '1+'}")
        event(f"prefix hits: {'0' if not sched.stats().prefix_hit_rate else '>0'}")
        for rid, expected in d.expected.items():
            reason = d.finish_reasons.get(rid)
            if reason is FinishReason.ABORT or rid in self.cut:
                # cut: outgrew the pool while senders or remote waits held blocks
                assert d.outputs[rid] == expected[: len(d.outputs[rid])]
            else:
                assert reason is not None, rid
                assert d.outputs[rid] == expected, rid


SchedulerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("SCHED_MACHINE_EXAMPLES", "100")),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestSchedulerMachine = SchedulerMachine.TestCase
