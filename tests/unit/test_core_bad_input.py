"""Bad input to the core: each call raises a typed error from pagedkv.errors and changes nothing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from pagedkv.core import BlockPool, CacheConfig, KVCacheManager, PoolConfig
from pagedkv.errors import (
    InvalidRequestError,
    OutOfBlocksError,
    PagedKVError,
    PromptTooLongError,
    RequestStateError,
    RollbackError,
    UnknownRequestError,
)
from reference.core_state import make_manager, manager_state, run_prompt


def _busy_manager() -> KVCacheManager:
    """Running "r" (9 committed + 2 scheduled), held "h", waiting "w", cached-free blocks."""
    m = make_manager(num_blocks=16, enable_events=True)
    run_prompt(m, "old", list(range(50, 58)))
    m.free("old")
    run_prompt(m, "r", list(range(9)))
    m.allocate_slots("r", 2)
    run_prompt(m, "h", [7] * 5)
    m.hold("h")
    m.add_request("w", [1, 2, 3])
    return m


BAD_CALLS: list[tuple[str, Callable[[KVCacheManager], Any], type[PagedKVError]]] = [
    ("allocate unknown", lambda m: m.allocate_slots("nope", 1), UnknownRequestError),
    ("commit unknown", lambda m: m.commit("nope", 1), UnknownRequestError),
    ("rollback unknown", lambda m: m.rollback("nope", 1), UnknownRequestError),
    ("append unknown", lambda m: m.append_tokens("nope", [1]), UnknownRequestError),
    ("free unknown", lambda m: m.free("nope"), UnknownRequestError),
    ("preempt unknown", lambda m: m.preempt("nope"), UnknownRequestError),
    ("hold unknown", lambda m: m.hold("nope"), UnknownRequestError),
    ("release unknown", lambda m: m.release("nope"), UnknownRequestError),
    ("fork unknown", lambda m: m.fork("nope", "c"), UnknownRequestError),
    ("match unknown", lambda m: m.match_prefix("nope"), UnknownRequestError),
    ("block table unknown", lambda m: m.block_table("nope"), UnknownRequestError),
    ("release not held", lambda m: m.release("r"), RequestStateError),
    ("free held", lambda m: m.free("h"), RequestStateError),
    ("preempt held", lambda m: m.preempt("h"), RequestStateError),
    ("hold with scheduled tokens", lambda m: m.hold("r"), RequestStateError),
    ("match running", lambda m: m.match_prefix("r"), RequestStateError),
    ("add duplicate id", lambda m: m.add_request("r", [1]), InvalidRequestError),
    ("add empty prompt", lambda m: m.add_request("x", []), InvalidRequestError),
    (
        "add negative max_tokens",
        lambda m: m.add_request("x", [1], max_tokens=-1),
        InvalidRequestError,
    ),
    ("add prompt larger than pool", lambda m: m.add_request("x", [1] * 61), PromptTooLongError),
    ("add negative token", lambda m: m.add_request("x", [1, -1]), InvalidRequestError),
    ("add token 2**32", lambda m: m.add_request("x", [1, 2**32]), InvalidRequestError),
    ("add huge token", lambda m: m.add_request("x", [2**70]), InvalidRequestError),
    ("add float tokens", lambda m: m.add_request("x", [1.5, 2.0]), InvalidRequestError),
    (
        "add bad token in full block",
        lambda m: m.add_request("x", [1] * 8 + [-3]),
        InvalidRequestError,
    ),
    ("append negative token", lambda m: m.append_tokens("r", [3, -1]), InvalidRequestError),
    ("append token 2**32", lambda m: m.append_tokens("w", [2**32]), InvalidRequestError),
    (
        "append bad token completing a block",
        lambda m: m.append_tokens("r", [1, 2, 3, -1]),
        InvalidRequestError,
    ),
    ("append to held", lambda m: m.append_tokens("h", [1]), RequestStateError),
    ("allocate zero", lambda m: m.allocate_slots("r", 0), InvalidRequestError),
    ("allocate negative", lambda m: m.allocate_slots("r", -1), InvalidRequestError),
    ("allocate negative lookahead", lambda m: m.allocate_slots("r", 1, -1), InvalidRequestError),
    ("allocate held", lambda m: m.allocate_slots("h", 1), RequestStateError),
    ("allocate more than the pool", lambda m: m.allocate_slots("r", 100), OutOfBlocksError),
    ("allocate lookahead beyond pool", lambda m: m.allocate_slots("w", 1, 100), OutOfBlocksError),
    ("commit negative", lambda m: m.commit("r", -1), InvalidRequestError),
    ("commit more than scheduled", lambda m: m.commit("r", 3), InvalidRequestError),
    ("commit unknown tokens", lambda m: m.commit("r", 2), InvalidRequestError),
    ("rollback negative", lambda m: m.rollback("r", -1), InvalidRequestError),
    ("rollback past commit", lambda m: m.rollback("r", 3), RollbackError),
    ("rollback waiting", lambda m: m.rollback("w", 1), RollbackError),
    ("fork onto existing id", lambda m: m.fork("h", "r"), InvalidRequestError),
    ("fork held", lambda m: m.fork("h", "c"), RequestStateError),
    ("fork waiting", lambda m: m.fork("w", "c"), RequestStateError),
    ("fork with scheduled tokens", lambda m: m.fork("r", "c"), RequestStateError),
    ("slot mapping past table", lambda m: m.slot_mapping("r", 0, 13), InvalidRequestError),
    ("slot mapping reversed", lambda m: m.slot_mapping("r", 5, 4), InvalidRequestError),
    ("slot mapping negative", lambda m: m.slot_mapping("r", -1, 2), InvalidRequestError),
    ("reset while in use", lambda m: m.reset_prefix_cache(), PagedKVError),
    ("clear while in use", lambda m: m.clear(), PagedKVError),
]


@pytest.mark.parametrize(
    ("call", "error"), [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS]
)
def test_bad_call_raises_typed_error_and_changes_nothing(
    call: Callable[[KVCacheManager], Any], error: type[PagedKVError]
) -> None:
    m = _busy_manager()
    before = manager_state(m)
    with pytest.raises(error):
        call(m)
    assert manager_state(m) == before
    m.check_invariants()


def test_fork_with_negative_max_tokens_changes_nothing() -> None:
    m = make_manager()
    run_prompt(m, "p", list(range(6)))
    before = manager_state(m)
    with pytest.raises(InvalidRequestError):
        m.fork("p", "c", max_tokens=-1)
    assert manager_state(m) == before
    m.check_invariants()


def test_double_free_raises_unknown_request() -> None:
    m = make_manager()
    run_prompt(m, "a", [1, 2, 3])
    m.free("a")
    before = manager_state(m)
    with pytest.raises(UnknownRequestError, match="unknown request 'a'"):
        m.free("a")
    assert manager_state(m) == before


def test_double_release_raises_unknown_request() -> None:
    m = make_manager()
    run_prompt(m, "a", [1, 2, 3])
    m.hold("a")
    m.release("a")
    with pytest.raises(UnknownRequestError):
        m.release("a")


def test_prompt_too_long_message_names_the_limit() -> None:
    m = make_manager(block_size=16, num_blocks=257)
    with pytest.raises(
        PromptTooLongError, match="prompt has 5000 tokens; the pool admits at most 4096"
    ):
        m.add_request("x", [1] * 5000)
    assert m.num_requests == 0


def test_numpy_prompt_is_accepted_like_a_list() -> None:
    m = make_manager()
    m.add_request("np", np.arange(9, dtype=np.int64))
    m.add_request("py", list(range(9)))
    assert m.block_hashes("np") == m.block_hashes("py")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"block_size": 0},
        {"block_size": -16},
        {"num_blocks": 1},
        {"num_blocks": 0},
        {"num_blocks": -5},
        {"num_blocks": 8, "initial_blocks": 9},
        {"num_blocks": 8, "initial_blocks": 1},
        {"num_blocks": 8, "initial_blocks": 0},
        {"growth_blocks": 0},
        {"watermark": 1.0},
        {"watermark": -0.1},
        {"max_events": 0},
        {"eviction_policy": "random"},
        {"hash_algo": "md5"},
        {"reservation": "everything"},
    ],
    ids=str,
)
def test_bad_config_value_raises_invalid_request(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError):
        CacheConfig(**kwargs)  # validated when the config is built, not later


def test_pool_without_null_block_accepts_one_block() -> None:
    pool = BlockPool(PoolConfig(num_blocks=1, use_null_block=False))
    assert pool.allocate(1) == [0]
    with pytest.raises(InvalidRequestError):
        PoolConfig(num_blocks=0, use_null_block=False)


def test_pool_bad_block_ids_raise_and_change_nothing() -> None:
    pool = BlockPool(PoolConfig(num_blocks=8))
    a = pool.allocate(2)
    with pytest.raises(InvalidRequestError):
        pool.allocate(-1)
    with pytest.raises(RequestStateError):
        pool.free([-1])  # a negative id never indexes from the end
    with pytest.raises(RequestStateError):
        pool.free([0])  # the null block
    with pytest.raises(RequestStateError):
        pool.free([a[0], 5])  # 5 is free: nothing is freed, not even a[0]
    with pytest.raises(RequestStateError):
        pool.free([a[0], a[0]])
    with pytest.raises(InvalidRequestError):
        pool.ref_count(-1)
    with pytest.raises(InvalidRequestError):
        pool.touch([99])
    with pytest.raises(RequestStateError):
        pool.touch([a[0], 6])  # 6 is free and uncached: no ref is taken on a[0] either
    with pytest.raises(OutOfBlocksError):
        pool.allocate(6)
    assert [pool.ref_count(b) for b in range(8)] == [0, 1, 1, 0, 0, 0, 0, 0]
    assert pool.num_free_blocks == 5
    pool.check_invariants()
