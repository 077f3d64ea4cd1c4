"""NodeBackoff: a failing node is skipped for a doubling, capped back-off; the others are not."""

from __future__ import annotations

import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.tiers.node_health import NodeBackoff


def test_only_the_failing_node_backs_off_doubling_to_the_cap() -> None:
    now = [0.0]
    health = NodeBackoff(1.0, 4.0, lambda: now[0])
    waits = [health.failed("a:1") for _ in range(4)]
    assert waits == [1.0, 2.0, 4.0, 4.0]
    assert health.is_down("a:1")
    assert not health.is_down("b:2")
    assert health.down_names() == ["a:1"]
    now[0] = 3.9
    assert health.is_down("a:1")
    now[0] = 4.0  # the re-probe time: the next operation may try it
    assert not health.is_down("a:1")
    assert not health.any_down()
    assert health.failed("a:1") == 4.0  # still failing: the wait stays at the cap
    health.check_invariants()
    assert health.succeeded("a:1")
    assert not health.succeeded("a:1")  # already healthy
    assert health.failed("a:1") == 1.0  # a success forgot the earlier failures
    health.check_invariants()


def test_nodes_back_off_independently() -> None:
    now = [0.0]
    health = NodeBackoff(1.0, 2.0, lambda: now[0])
    health.failed("a:1")
    now[0] = 0.5
    health.failed("b:2")
    assert health.down_names() == ["a:1", "b:2"]
    now[0] = 1.0
    assert health.down_names() == ["b:2"]  # a's back-off ran out first
    assert health.succeeded("b:2")
    assert health.down_names() == []
    health.check_invariants()


@pytest.mark.parametrize(("initial", "cap"), [(0.0, 1.0), (2.0, 1.0), (-1.0, 1.0)])
def test_bad_back_off_bounds_are_refused(initial: float, cap: float) -> None:
    with pytest.raises(InvalidRequestError, match="backoff_initial_s"):
        NodeBackoff(initial, cap, lambda: 0.0)
