"""Workload records and the built-in generators: validation, determinism, shared prefixes."""

from __future__ import annotations

import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.sim import SimRequest, Workload, make_workload, token_run
from pagedkv.sim.generators import WORKLOADS


def _req(rid: str, t: float = 0.0, **kw: object) -> SimRequest:
    return SimRequest(rid, t, (1, 2, 3), 4, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"arrival_s": -1.0}, "arrival_s"),
        ({"arrival_s": float("nan")}, "arrival_s"),
        ({"prompt_token_ids": ()}, "empty"),
        ({"output_len": 0}, "output_len"),
        ({"output_token_ids": (5, 6)}, "output_token_ids has 2"),
        ({"think_s": -0.5}, "think_s"),
        ({"follows": "r"}, "itself"),
        ({"request_id": ""}, "request_id"),
    ],
)
def test_sim_request_rejects_bad_values(kwargs: dict[str, object], fragment: str) -> None:
    base: dict[str, object] = {
        "request_id": "r",
        "arrival_s": 0.0,
        "prompt_token_ids": (1, 2),
        "output_len": 3,
    }
    base.update(kwargs)
    with pytest.raises(InvalidRequestError, match=fragment):
        SimRequest(**base)  # type: ignore[arg-type]


def test_workload_sorts_by_arrival_and_checks_ids_and_follows() -> None:
    w = Workload("w", (_req("b", 2.0), _req("a", 1.0), _req("c", 2.0, follows="b")))
    assert [r.request_id for r in w.requests] == ["a", "b", "c"]
    w.check_invariants()
    with pytest.raises(InvalidRequestError, match="duplicate"):
        Workload("w", (_req("a"), _req("a")))
    with pytest.raises(InvalidRequestError, match="not an earlier request"):
        Workload("w", (_req("a", 1.0, follows="b"), _req("b", 2.0)))
    with pytest.raises(InvalidRequestError, match="not an earlier request"):
        Workload("w", (_req("a", follows="nobody"),))


def test_token_run_is_deterministic_and_prefix_closed() -> None:
    long = token_run(7, "doc", 1000)
    assert token_run(7, "doc", 300) == long[:300]  # a shorter run is a prefix of a longer one
    assert token_run(7, "doc", 1000) == long
    assert token_run(8, "doc", 1000) != long
    assert token_run(7, "other", 1000) != long
    assert all(isinstance(t, int) and 100 <= t < 32_000 for t in long)


@pytest.mark.parametrize("name", WORKLOADS)
def test_generators_are_deterministic_per_seed(name: str) -> None:
    a = make_workload(name, seed=3, num_requests=60)
    b = make_workload(name, seed=3, num_requests=60)
    c = make_workload(name, seed=4, num_requests=60)
    assert a == b
    assert a.requests != c.requests
    assert len(a) >= 60
    a.check_invariants()


def _common_prefix(x: tuple[int, ...], y: tuple[int, ...]) -> int:
    n = 0
    for p, q in zip(x, y, strict=False):
        if p != q:
            break
        n += 1
    return n


def test_chat_turns_resend_the_whole_conversation() -> None:
    w = make_workload("chat", seed=1, num_requests=30)
    by_id = {r.request_id: r for r in w.requests}
    followers = [r for r in w.requests if r.follows is not None]
    assert followers
    for r in followers:
        prev = by_id[r.follows]  # type: ignore[index]
        assert prev.output_token_ids is not None
        sent_before = prev.prompt_token_ids + prev.output_token_ids
        assert r.prompt_token_ids[: len(sent_before)] == sent_before
        assert r.session_id == prev.session_id


def test_agent_context_grows_and_sessions_share_the_tool_prefix() -> None:
    w = make_workload("agent", seed=2, num_requests=40)
    firsts = [r for r in w.requests if r.follows is None]
    assert len(firsts) >= 2
    assert _common_prefix(firsts[0].prompt_token_ids, firsts[1].prompt_token_ids) >= 1_500
    by_id = {r.request_id: r for r in w.requests}
    for r in w.requests:
        if r.follows is not None:
            prev = by_id[r.follows]
            assert prev.output_token_ids is not None
            grown = prev.prompt_token_ids + prev.output_token_ids
            assert r.prompt_token_ids[: len(grown)] == grown
            assert r.num_prompt_tokens > len(grown)  # plus the tool result


def test_system_and_rag_share_prefixes_and_tenants_are_salted() -> None:
    sys_w = make_workload("system", seed=0, num_requests=50)
    heads = {r.prompt_token_ids[:800] for r in sys_w.requests}
    assert len(heads) <= 4  # four system prompts, each at least 800 tokens
    assert {r.cache_salt for r in sys_w.requests} == {"tenant-a", "tenant-b"}
    rag = make_workload("rag", seed=0, num_requests=50)
    shared = [
        _common_prefix(rag.requests[0].prompt_token_ids, r.prompt_token_ids) for r in rag.requests
    ]
    assert min(shared) >= 150  # the RAG system prompt
    assert max(shared[1:]) > 350  # some later request starts with the same first document


def test_mixed_combines_every_part_with_distinct_ids() -> None:
    w = make_workload("mixed", seed=0, num_requests=100)
    kinds = {r.request_id.split("-")[0] for r in w.requests}
    assert kinds == {"chat", "system", "agent", "rag"}
    assert len({r.request_id for r in w.requests}) == len(w)
    assert w.max_total_tokens <= 6_000


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"num_requests": 0}, "num_requests"),
        ({"rate": 0.0}, "rate"),
        ({"max_context": 10}, "max_context"),
        ({"seed": -1}, "seed"),
    ],
)
def test_make_workload_rejects_bad_arguments(kwargs: dict[str, object], fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment):
        make_workload("chat", **kwargs)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="unknown workload"):
        make_workload("nope")
