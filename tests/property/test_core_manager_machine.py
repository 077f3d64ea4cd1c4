"""A hypothesis state machine over KVCacheManager, checked against the naive reference model.

After every step: the manager's own invariants; every request's block table, committed and
scheduled counts and prefix hit equal the model's (exact block ids); free, used, cached, shared
and claim counters, the free stack and the eviction order equal the model's. A failing operation
must raise the same error class as the model and change nothing.

The content check: each block's KV is simulated as the token ids written into its slots (drafts
as -1 at allocation, the real token at commit, whole blocks copied for copy-on-write). Every
request's committed positions must read back its own tokens (so every prefix hit is checked),
every block in the prefix index must hold the tokens its hash names (cached-free blocks too),
and a hash may never name two contents: a stale hash, a wrong eviction, a collision or a write
into a shared block fails.

``pytest -s`` prints what the machine explored (operations, hits, copies, evictions, duplicate
commits, failures by error class); the test asserts minimums for each, so a change that stops
the machine from reaching an edge fails instead of passing vacuously.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedkv.core import CacheConfig, HashContext, KVCacheManager, ReservationPolicy
from pagedkv.errors import PagedKVError
from reference.core_model import RefManager
from reference.core_state import manager_state

BS = 4
DRAFT = -1
GHOST = "ghost"  # an id that is never registered
PREFIXES = [
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
    [11, 12, 13, 14, 30, 31, 32, 33],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49],
]
BAD_TOKENS = [-1, 2**32]
MAX_LIVE = 10  # live requests at most (forks may add a few): keeps each step cheap


@dataclass(frozen=True)
class Setup:
    num_blocks: int
    initial_blocks: int | None = None
    growth_blocks: int = 64
    use_null_block: bool = True
    watermark: float = 0.0
    reserve_max_tokens: bool = True
    prefix_caching: bool = True


SETUPS = [  # small pools, so that allocations evict cached blocks often
    Setup(num_blocks=16),
    Setup(num_blocks=10),
    Setup(num_blocks=20, initial_blocks=5, growth_blocks=3),
    Setup(num_blocks=14, watermark=0.15, reserve_max_tokens=False),
    Setup(num_blocks=12, use_null_block=False),
    Setup(num_blocks=12, prefix_caching=False),
]

# Suffixes from a tiny alphabet repeat (duplicate content, hits past the shared prefixes); from a
# large one they fill the cache with distinct blocks (evictions).
tokens = st.lists(st.integers(0, 3), max_size=9) | st.lists(st.integers(100, 10**6), max_size=9)
prompt = st.tuples(
    st.integers(0, len(PREFIXES)), st.sampled_from([4, 8, 12, 12, 12, 3, 6, 9]), tokens
)
pick = st.integers(1, 10**6)  # not 0: hypothesis favours 0, and 0 % 13 picks the unknown id
flaw = st.sampled_from(["", "", "", "", "", "", "", "", "token", "max_tokens", "long", "dup_id"])
# A request's namespace: no salt, a cache salt, or a LoRA adapter (carried by every block). The
# model treats each as an opaque name: requests in different namespaces never share a block.
salt = st.sampled_from([None, None, None, "salt:tenant-b", "lora:sql"])


class OpCounter:
    """Counts across all examples, so the test can show what the machine explored."""

    ops = 0
    failed: ClassVar[dict[str, int]] = {}
    hits = 0
    copies = 0
    evictions = 0
    duplicates = 0


class CoreManagerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.m: KVCacheManager
        self.ref: RefManager
        self.kv: dict[int, int] = {}  # slot -> simulated KV (the token written there)
        self.named: dict[bytes, list[int]] = {}  # block hash -> the tokens of the block it names
        self.next_id = 0

    @initialize(setup=st.sampled_from(SETUPS))
    def setup(self, setup: Setup) -> None:
        self.m = KVCacheManager(
            CacheConfig(
                block_size=BS,
                num_blocks=setup.num_blocks,
                initial_blocks=setup.initial_blocks,
                growth_blocks=setup.growth_blocks,
                use_null_block=setup.use_null_block,
                watermark=setup.watermark,
                reservation=ReservationPolicy.MAX_TOKENS
                if setup.reserve_max_tokens
                else ReservationPolicy.NONE,
                enable_prefix_caching=setup.prefix_caching,
            )
        )
        self.ref = RefManager(
            block_size=BS,
            num_blocks=setup.num_blocks,
            initial_blocks=setup.initial_blocks,
            growth_blocks=setup.growth_blocks,
            use_null_block=setup.use_null_block,
            watermark=setup.watermark,
            reserve_max_tokens=setup.reserve_max_tokens,
            prefix_caching=setup.prefix_caching,
        )

    # ------------------------------------------------------------------ helpers
    def both(self, expected: Callable[[], Any], actual: Callable[[], Any]) -> tuple[bool, Any]:
        """Run an operation on the model, then on the manager; compare outcomes."""
        OpCounter.ops += 1
        want_error: PagedKVError | None = None
        try:
            want = expected()
        except PagedKVError as exc:
            want_error = exc
        if want_error is None:
            return True, (want, actual())
        before = manager_state(self.m)
        got_error: PagedKVError | None = None
        try:
            actual()
        except PagedKVError as exc:
            got_error = exc
        assert type(got_error) is type(want_error), f"manager: {got_error!r}, model: {want_error!r}"
        assert manager_state(self.m) == before, "a failed operation changed the manager"
        name = type(want_error).__name__
        OpCounter.failed[name] = OpCounter.failed.get(name, 0) + 1
        return False, None

    def rid(self, n: int, *, ghost_every: int = 13) -> str:
        """A live request id picked by ``n``; one pick in ``ghost_every`` is an unknown id."""
        ids = sorted(self.ref.reqs)
        if not ids or n % ghost_every == 0:
            return GHOST
        return ids[n % len(ids)]

    def waiting(self) -> list[str]:
        return sorted(r for r, req in self.ref.reqs.items() if not req.started and not req.held)

    def new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    def write(self, rid: str, start: int, end: int, values: list[int] | None) -> None:
        """The runner writes KV for positions [start, end) at the request's slot mapping."""
        if end <= start:
            return
        slots = self.m.slot_mapping(rid, start, end).tolist()
        for i, slot in enumerate(slots):
            self.kv[slot] = DRAFT if values is None else values[i]

    def check_hit_content(self, rid: str) -> None:
        tokens = self.m.token_ids(rid)
        for i, b in enumerate(self.m.block_ids(rid)[: self.m.num_hit_tokens(rid) // BS]):
            got = [self.kv.get(b * BS + o) for o in range(BS)]
            assert got == tokens[i * BS : (i + 1) * BS], f"prefix hit block {b} holds {got}"

    # ------------------------------------------------------------------ rules
    @rule(p=prompt, max_tokens=st.integers(0, 12), salt=salt, bad=flaw)
    @precondition(lambda self: len(self.ref.reqs) < MAX_LIVE)
    def add_request(
        self, p: tuple[int, int, list[int]], max_tokens: int, salt: str | None, bad: str
    ) -> None:
        which, cut, suffix = p
        toks = (PREFIXES[which][:cut] if which < len(PREFIXES) else []) + suffix
        if bad == "token":
            toks = [*toks, BAD_TOKENS[len(toks) % 2]]
        elif bad == "max_tokens":
            max_tokens = -1
        elif bad == "long":
            toks = toks * 10  # maybe larger than the pool
        rid = self.rid(len(toks) + 1, ghost_every=10**9) if bad == "dup_id" else self.new_id()
        self.both(
            lambda: self.ref.add(rid, toks, max_tokens, salt),
            lambda: self.m.add_request(
                rid,
                toks,
                max_tokens=max_tokens,
                cache_salt=salt[5:] if salt and salt.startswith("salt:") else None,
                hash_context=HashContext(adapter_id=salt[5:])
                if salt and salt.startswith("lora:")
                else None,
            ),
        )

    @rule(p=prompt, max_tokens=st.integers(0, 12), salt=salt)
    @precondition(lambda self: len(self.ref.reqs) < MAX_LIVE)
    def add_valid_request(
        self, p: tuple[int, int, list[int]], max_tokens: int, salt: str | None
    ) -> None:
        self.add_request(p, max_tokens, salt, bad="")

    @rule(i=pick, j=pick)
    @precondition(lambda self: bool(self.ref.reqs))
    def prefill_concurrently(self, i: int, j: int) -> None:
        """Two waiting requests computed in the same step: equal content becomes a duplicate."""
        waiting = self.waiting()
        if len(waiting) < 2:
            return
        a, b = waiting[i % len(waiting)], waiting[j % len(waiting)]
        if a == b:
            return
        todo = []
        for rid in (a, b):
            req = self.ref.reqs[rid]
            n = len(req.tokens) - len(self.ref.hit_blocks(req)) * BS
            if self._allocate(rid, n, 0):
                todo.append((rid, n))
        for rid, n in todo:
            self._commit(rid, n)

    @rule(p=prompt, salt=salt)
    @precondition(lambda self: len(self.ref.reqs) < MAX_LIVE)
    def prefill_twins(self, p: tuple[int, int, list[int]], salt: str | None) -> None:
        """The same prompt arrives twice and both are computed in one step (duplicate hashes)."""
        self.add_request(p, 0, salt, bad="")
        self.add_request(p, 0, salt, bad="")
        a, b = f"r{self.next_id - 1}", f"r{self.next_id}"
        todo = []
        for rid in (a, b):
            req = self.ref.reqs.get(rid)
            if req is None:
                return
            n = len(req.tokens) - len(self.ref.hit_blocks(req)) * BS
            if self._allocate(rid, n, 0):
                todo.append((rid, n))
        for rid, n in todo:
            self._commit(rid, n)

    @rule(i=pick)
    @precondition(lambda self: bool(self.ref.reqs))
    def free_again(self, i: int) -> None:
        self.free(i)

    def _allocate(self, rid: str, n: int, lookahead: int) -> bool:
        req = self.ref.reqs.get(rid)
        start = None
        if req is not None and req.started:
            start = req.computed + req.pending
        ok, out = self.both(
            lambda: self.ref.allocate(rid, n, lookahead),
            lambda: self.m.allocate_slots(rid, n, lookahead),
        )
        if not ok:
            return False
        assert out is not None
        (want_new, want_copies), alloc = out
        assert list(alloc.new_block_ids) == want_new
        assert list(alloc.copies) == want_copies
        OpCounter.copies += len(alloc.copies)
        for src, dst in alloc.copies:
            for o in range(BS):
                if src * BS + o in self.kv:
                    self.kv[dst * BS + o] = self.kv[src * BS + o]
        if start is None:  # the first allocation took the prefix hit
            self.check_hit_content(rid)
            OpCounter.hits += self.m.num_hit_tokens(rid) > 0
            start = self.m.num_computed_tokens(rid)
        self.write(rid, start, start + n + lookahead, None)
        return True

    @rule(i=pick, n=st.integers(-1, 9), lookahead=st.integers(-1, 6))
    @precondition(lambda self: bool(self.ref.reqs))
    def allocate_slots(self, i: int, n: int, lookahead: int) -> None:
        self._allocate(self.rid(i), n, max(lookahead, 0) if i % 7 else lookahead)

    def _commit(self, rid: str, n: int) -> None:
        req = self.ref.reqs.get(rid)
        start = req.computed if req is not None else 0
        ok, _ = self.both(lambda: self.ref.commit(rid, n), lambda: self.m.commit(rid, n))
        if ok:
            tokens = self.m.token_ids(rid)
            self.write(rid, start, start + n, tokens[start : start + n])
            hashes = self.m.block_hashes(rid)  # empty without prefix caching
            for i in range(start // BS, min((start + n) // BS, len(hashes))):
                block = tokens[i * BS : (i + 1) * BS]
                named = self.named.setdefault(hashes[i], block)
                assert named == block, f"hash {hashes[i].hex()} names {named} and {block}"

    @rule(i=pick, n=st.integers(-1, 9))
    @precondition(lambda self: bool(self.ref.reqs))
    def commit(self, i: int, n: int) -> None:
        self._commit(self.rid(i), n)

    @rule(i=pick, toks=tokens, bad=flaw)
    @precondition(lambda self: bool(self.ref.reqs))
    def append_tokens(self, i: int, toks: list[int], bad: str) -> None:
        rid = self.rid(i)
        if bad == "token":
            toks = [*toks, BAD_TOKENS[i % 2]]
        self.both(lambda: self.ref.append(rid, toks), lambda: self.m.append_tokens(rid, toks))

    @rule(i=pick, n=st.integers(-1, 9))
    @precondition(lambda self: bool(self.ref.reqs))
    def rollback(self, i: int, n: int) -> None:
        rid = self.rid(i)
        self.both(lambda: self.ref.rollback(rid, n), lambda: self.m.rollback(rid, n))

    @rule(i=pick, j=pick, max_tokens=st.none() | st.integers(-1, 8))
    @precondition(lambda self: bool(self.ref.reqs))
    def fork(self, i: int, j: int, max_tokens: int | None) -> None:
        parent = self.rid(i)
        child = self.rid(j, ghost_every=3) if j % 5 == 0 else self.new_id()
        if child == GHOST:
            child = self.new_id()
        self.both(
            lambda: self.ref.fork(parent, child, max_tokens),
            lambda: self.m.fork(parent, child, max_tokens=max_tokens),
        )

    @rule(i=pick, tok=st.integers(0, 3), parent_writes=st.booleans())
    @precondition(lambda self: bool(self.ref.reqs))
    def fork_then_write(self, i: int, tok: int, parent_writes: bool) -> None:
        """Beam search: fork, then one side writes first (copy-on-write of a partial block)."""
        parent = self.rid(i, ghost_every=10**9)
        child = self.new_id()
        ok, _ = self.both(
            lambda: self.ref.fork(parent, child, None),
            lambda: self.m.fork(parent, child),
        )
        if not ok:
            return
        for rid in (parent, child) if parent_writes else (child, parent):
            self.both(
                lambda r=rid: self.ref.append(r, [tok]),
                lambda r=rid: self.m.append_tokens(r, [tok]),
            )
            scheduled_end = self.ref.reqs[rid].computed + self.ref.reqs[rid].pending
            if scheduled_end < len(self.ref.reqs[rid].tokens) and self._allocate(rid, 1, 0):
                self._commit(rid, 1)

    @rule(i=pick)
    @precondition(lambda self: bool(self.ref.reqs))
    def preempt(self, i: int) -> None:
        rid = self.rid(i)
        self.both(lambda: self.ref.preempt(rid), lambda: self.m.preempt(rid))

    @rule(i=pick)
    @precondition(lambda self: bool(self.ref.reqs))
    def free(self, i: int) -> None:
        rid = self.rid(i)
        self.both(lambda: self.ref.free(rid), lambda: self.m.free(rid))

    @rule(i=pick)
    @precondition(lambda self: bool(self.ref.reqs))
    def hold(self, i: int) -> None:
        rid = self.rid(i)
        self.both(lambda: self.ref.hold(rid), lambda: self.m.hold(rid))

    @rule(i=pick)
    @precondition(lambda self: bool(self.ref.reqs))
    def release(self, i: int) -> None:
        rid = self.rid(i, ghost_every=5)
        self.both(lambda: self.ref.release(rid), lambda: self.m.release(rid))

    @rule()
    def reset_prefix_cache(self) -> None:
        self.both(self.ref.reset_prefix_cache, self.m.reset_prefix_cache)

    @rule()
    def clear(self) -> None:
        self.both(self.ref.clear, self.m.clear)

    @rule(i=pick, k=st.integers(1, 4), lookahead=st.integers(0, 4), accept=st.integers(0, 4))
    @precondition(lambda self: bool(self.ref.reqs))
    def schedule_step(self, i: int, k: int, lookahead: int, accept: int) -> None:
        """A realistic step: prefill a waiting request, or decode k drafts and accept some."""
        rid = self.rid(i, ghost_every=10**9)
        req = self.ref.reqs.get(rid)
        if req is None or req.held:
            return
        if not req.started:
            self.m.can_admit(rid)  # as the scheduler does: match, admission check, allocate
            n = len(req.tokens) - len(self.ref.hit_blocks(req)) * BS
            if self._allocate(rid, n, lookahead):
                self._commit(rid, n)
            return
        if not self._allocate(rid, k, lookahead):
            return
        accept = min(accept, req.pending)
        missing = req.computed + accept - len(req.tokens)
        if missing > 0:
            new = [(i + t) % 4 for t in range(missing)]
            self.both(lambda: self.ref.append(rid, new), lambda: self.m.append_tokens(rid, new))
        self._commit(rid, accept)
        rest = req.pending
        self.both(lambda: self.ref.rollback(rid, rest), lambda: self.m.rollback(rid, rest))

    @rule(i=pick, k=st.integers(1, 4), lookahead=st.integers(0, 4), accept=st.integers(0, 4))
    @precondition(lambda self: bool(self.ref.reqs))
    def schedule_step_again(self, i: int, k: int, lookahead: int, accept: int) -> None:
        """The same step as a second rule, so realistic steps are drawn twice as often."""
        self.schedule_step(i, k, lookahead, accept)

    @rule(i=pick, k=st.integers(1, 4), lookahead=st.integers(0, 4), accept=st.integers(0, 4))
    @precondition(lambda self: bool(self.ref.reqs))
    def schedule_step_third(self, i: int, k: int, lookahead: int, accept: int) -> None:
        self.schedule_step(i, k, lookahead, accept)

    @rule(i=pick)
    @precondition(lambda self: bool(self.ref.reqs))
    def match_prefix(self, i: int) -> None:
        """A waiting request's match is exact (memoized only while nothing changes)."""
        rid = self.rid(i, ghost_every=10**9)
        req = self.ref.reqs.get(rid)
        if req is None or req.started:
            return
        before = manager_state(self.m)
        match = self.m.match_prefix(rid)
        self.m.can_admit(rid)
        self.m.num_blocks_to_admit(rid)
        assert manager_state(self.m) == before, "a read-only query changed the manager"
        fresh = self.ref.hit_blocks(req)
        assert list(match.block_ids) == fresh
        assert match.num_cached_tokens == len(match.block_ids) * BS
        refs = [self.m.pool.ref_count(b) for b in match.block_ids]
        assert match.num_evictable_blocks == refs.count(0)

    def teardown(self) -> None:
        if hasattr(self, "m"):
            stats = self.m.stats()
            OpCounter.evictions += stats.num_evictions
            OpCounter.duplicates += stats.num_duplicate_commits

    # ------------------------------------------------------------------ invariants
    @invariant()
    def manager_invariants_hold(self) -> None:
        self.m.check_invariants()

    @invariant()
    def matches_reference_model(self) -> None:
        m, ref, pool = self.m, self.ref, self.m.pool
        assert sorted(ref.reqs) == sorted(m._seqs)
        for rid, req in ref.reqs.items():
            assert m.block_ids(rid) == req.blocks, rid
            assert m.num_computed_tokens(rid) == req.computed, rid
            assert m.num_pending_tokens(rid) == req.pending, rid
            assert m.token_ids(rid) == req.tokens, rid
            assert m.num_hit_tokens(rid) == req.hit_tokens, rid
            assert m.is_held(rid) == req.held, rid
        assert pool.num_materialized_blocks == ref.materialized
        assert pool.num_free_blocks == ref.num_free
        assert pool.num_used_blocks == ref.num_used
        assert pool.num_cached_blocks == ref.num_cached
        assert pool.num_cached_free_blocks == ref.num_cached_free
        assert pool.num_shared_blocks == ref.num_shared
        assert pool.eviction_order() == ref.lru
        assert pool._free_uncached == ref.stack
        assert m.running_claim_blocks == ref.running_claim
        assert pool.usage == ref.num_used / ref.capacity

    @invariant()
    def every_cached_block_holds_what_its_hash_names(self) -> None:
        """Cached-free blocks too, not only hits: a stale hash fails here at once."""
        for h, b in self.m.pool._index.items():
            got = [self.kv.get(b * BS + o) for o in range(BS)]
            assert got == self.named[h], f"block {b} holds {got}, its hash names {self.named[h]}"

    @invariant()
    def committed_positions_hold_their_tokens(self) -> None:
        for rid, req in self.ref.reqs.items():
            if not req.started or req.computed == 0:
                continue
            slots = self.m.slot_mapping(rid, 0, req.computed).tolist()
            got = [self.kv.get(s) for s in slots]
            assert got == req.tokens[: req.computed], f"{rid}: KV {got} != {req.tokens}"


def test_core_manager_machine() -> None:
    """At least 10,000 random operations against the reference model, reaching every edge."""
    OpCounter.ops = OpCounter.hits = OpCounter.copies = OpCounter.evictions = 0
    OpCounter.duplicates = 0
    OpCounter.failed = {}
    run_state_machine_as_test(
        CoreManagerMachine,
        settings=settings(
            max_examples=300,
            stateful_step_count=70,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
    print(
        f"\n{OpCounter.ops} ops, {OpCounter.hits} hits, {OpCounter.copies} copies, "
        f"{OpCounter.evictions} evictions, {OpCounter.duplicates} duplicates, failed: "
        f"{OpCounter.failed}"
    )
    assert OpCounter.ops >= 10_000, f"only {OpCounter.ops} operations ran"
    # The machine must reach the interesting edges, or it proves little.
    assert OpCounter.hits >= 50, OpCounter.hits
    assert OpCounter.copies >= 20, OpCounter.copies
    assert OpCounter.evictions >= 30, OpCounter.evictions
    assert OpCounter.duplicates >= 10, OpCounter.duplicates
    expected_failures = {
        "UnknownRequestError",
        "InvalidRequestError",
        "PromptTooLongError",
        "RequestStateError",
        "RollbackError",
        "OutOfBlocksError",
        "CacheBusyError",
    }
    assert expected_failures <= set(OpCounter.failed), OpCounter.failed
