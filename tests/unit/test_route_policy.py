"""The pure routing layer: the block-hash index of engines' caches and the policies over it."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.core.hashing import hash_blocks
from pagedkv.errors import InvalidRequestError, OverloadedError
from pagedkv.route import (
    CacheAware,
    CacheAwareConfig,
    EngineLoad,
    LeastLoad,
    PrefixIndex,
    RoundRobin,
    make_policy,
)

BS = 4


def _chain(seed: int, num_blocks: int) -> list[bytes]:
    return hash_blocks([seed * 1000 + i for i in range(num_blocks * BS)], BS)


def test_match_counts_each_engines_run_from_the_first_block() -> None:
    idx: PrefixIndex[str] = PrefixIndex()
    h = _chain(1, 6)
    idx.store("a", h[:4], "GPU")
    idx.store("b", h[:2], "GPU")
    idx.store("b", h[3:6], "GPU")  # a hole at block 2: b's run stops at 2
    idx.store("c", h[1:6], "GPU")  # no first block: no match at all
    assert idx.match(h) == {"a": 4, "b": 2}
    idx.check_invariants()


def test_a_block_stays_while_any_local_medium_holds_it_and_redis_is_ignored() -> None:
    idx: PrefixIndex[str] = PrefixIndex()
    h = _chain(2, 2)
    idx.store("a", h, "GPU")
    idx.store("a", h, "cpu")
    idx.store("b", h, "redis")  # shared by all engines: says nothing about b
    idx.remove("a", h, "GPU")  # evicted from the device, still in a's host tier
    assert idx.match(h) == {"a": 2}
    idx.remove("a", h[1:], "cpu")
    assert idx.match(h) == {"a": 1}
    idx.clear("a")
    assert idx.match(h) == {}
    assert idx.num_blocks("a") == 0
    idx.check_invariants()


def test_a_routed_guess_is_dropped_with_the_engines_removal_or_failure() -> None:
    idx: PrefixIndex[str] = PrefixIndex()
    h = _chain(3, 3)
    idx.note_routed("a", h)
    assert idx.match(h) == {"a": 3}
    idx.remove("a", h[2:], "GPU")  # the engine evicted the last block: the guess goes too
    assert idx.match(h) == {"a": 2}
    idx.store("b", h, "GPU")
    idx.drop_engine("a")
    assert idx.match(h) == {"b": 3}
    idx.check_invariants()


def test_routed_guesses_are_bounded_and_age_out_oldest_first() -> None:
    idx: PrefixIndex[str] = PrefixIndex(max_routed=3)
    a, b = _chain(11, 2), _chain(12, 3)
    idx.store("x", a[:1], "GPU")  # confirmed by the engine: never aged out
    idx.note_routed("x", a)
    idx.note_routed("y", b)  # 5 guesses > 3: x's two go first
    assert idx.match(a) == {"x": 1}
    assert idx.match(b) == {"y": 3}
    idx.check_invariants()
    with pytest.raises(InvalidRequestError, match="max_routed"):
        PrefixIndex(max_routed=0)


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["store", "remove", "clear", "drop"]),
            st.sampled_from(["a", "b", "c"]),
            st.lists(st.integers(0, 7), max_size=5),
            st.sampled_from(["GPU", "cpu", "disk", "redis", "routed"]),
        ),
        max_size=40,
    )
)
def test_index_matches_a_naive_model(ops: list[tuple[str, str, list[int], str]]) -> None:
    chain = _chain(4, 8)
    idx: PrefixIndex[str] = PrefixIndex()
    model: dict[str, dict[bytes, set[str]]] = {}
    for op, eng, blocks, medium in ops:
        hs = [chain[i] for i in blocks]
        held = model.setdefault(eng, {})
        if op == "store":
            idx.store(eng, hs, medium)
            if medium != "redis":
                for h in hs:
                    held.setdefault(h, set()).add(medium)
        elif op == "remove":
            idx.remove(eng, hs, medium)
            if medium != "redis":
                for h in hs:
                    if h in held:
                        held[h] -= {medium, "routed"}
                        if not held[h]:
                            del held[h]
        elif op == "clear":
            idx.clear(eng)
            held.clear()
        else:
            idx.drop_engine(eng)
            held.clear()
        idx.check_invariants()
    expected: dict[str, int] = {}
    for eng, held in model.items():
        n = 0
        while n < len(chain) and chain[n] in held:
            n += 1
        if n:
            expected[eng] = n
    assert idx.match(chain) == expected


def _loads(**loads: int) -> list[EngineLoad[str]]:
    return [EngineLoad(e, n) for e, n in loads.items()]


def test_cache_aware_follows_the_prefix_unless_the_load_is_imbalanced() -> None:
    idx: PrefixIndex[str] = PrefixIndex()
    h = _chain(5, 10)
    idx.store("b", h[:8], "GPU")
    idx.store("c", _chain(6, 50), "GPU")
    policy = CacheAware(
        idx, CacheAwareConfig(0.3, balance_abs_threshold=4, balance_rel_threshold=1.5)
    )
    d = policy.choose(h, _loads(a=0, b=3, c=0))
    assert (d.engine, d.matched_blocks, d.reason) == ("b", 8, "cache")
    d = policy.choose(h, _loads(a=0, b=5, c=1))  # 5 - 0 > 4 and 5 > 0 * 1.5: imbalanced
    assert (d.engine, d.reason) == ("a", "balance")
    d = policy.choose(h[:1] + _chain(7, 9), _loads(a=0, b=0, c=0))  # 1/10 <= 0.3: not by cache
    assert (d.engine, d.reason) == ("a", "room")  # a holds the fewest blocks
    d = policy.choose(_chain(8, 4), _loads(a=2, b=0, c=0))  # room before load, as SGLang
    assert (d.engine, d.reason) == ("a", "room")
    idx.store("a", _chain(10, 9), "GPU")  # now a holds 9 blocks, b 8, c 50
    d = policy.choose(_chain(8, 4), _loads(a=0, b=2, c=0))
    assert (d.engine, d.reason) == ("b", "room")


def test_ties_on_the_prefix_go_to_the_least_loaded_holder() -> None:
    idx: PrefixIndex[str] = PrefixIndex()
    h = _chain(9, 4)
    idx.store("a", h, "GPU")
    idx.store("b", h, "GPU")
    d = CacheAware(idx).choose(h, _loads(a=3, b=1, c=0))
    assert (d.engine, d.reason, d.matched_blocks) == ("b", "cache", 4)


def test_round_robin_and_least_load_ignore_the_cache() -> None:
    rr: RoundRobin[str] = RoundRobin()
    engines = _loads(a=5, b=0, c=9)
    assert [rr.choose([], engines).engine for _ in range(4)] == ["a", "b", "c", "a"]
    assert LeastLoad[str]().choose([], engines).engine == "b"


def test_no_engine_and_bad_settings_are_refused() -> None:
    idx: PrefixIndex[str] = PrefixIndex()
    for name in ("cache-aware", "least-load", "round-robin"):
        with pytest.raises(OverloadedError, match="no healthy engine"):
            make_policy(name, idx).choose([], [])
    with pytest.raises(InvalidRequestError, match="unknown routing policy"):
        make_policy("random", idx)
    with pytest.raises(InvalidRequestError, match="cache_threshold"):
        CacheAwareConfig(cache_threshold=1.5)
    with pytest.raises(InvalidRequestError, match="balance_rel_threshold >= 1"):
        CacheAwareConfig(balance_rel_threshold=0.5)


def test_route_is_pure_no_torch_zmq_or_http_client() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pagedkv.route, pagedkv.sim.replicas; "
        "bad = [m for m in ('torch', 'zmq', 'httpx', 'msgspec') if m in sys.modules]; "
        "assert not bad, bad"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
