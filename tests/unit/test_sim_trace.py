"""JSONL traces: round trip, prefix-group expansion, a typed error naming the line of a bad one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.sim import load_trace, make_workload, parse_trace, save_trace


def test_save_then_load_gives_the_same_requests(tmp_path: Path) -> None:
    w = make_workload("mixed", seed=5, num_requests=40)
    path = tmp_path / "mixed.jsonl"
    save_trace(w, path)
    back = load_trace(path)
    assert back.name == "mixed.jsonl"
    assert back.requests == w.requests  # tokens, outputs, follows, salts, priorities, times
    assert len(path.read_text().splitlines()) == len(w)


def test_prefix_groups_expand_to_shared_runs() -> None:
    lines = [
        '{"request_id": "a", "arrival_s": 0, "prefix_group": "sys-1", "prefix_len": 512, '
        '"suffix_len": 64, "output_len": 8}',
        '{"request_id": "b", "arrival_s": 1.5, "prefix_group": "sys-1", "prefix_len": 256, '
        '"suffix_len": 64, "output_len": 8}',
        '{"request_id": "c", "arrival_s": 2, "prefix_group": "sys-2", "prefix_len": 512, '
        '"output_len": 8, "session_id": "s", "priority": 3, "cache_salt": "t1", "tag": "sys"}',
        "",  # blank lines are skipped
    ]
    w = parse_trace(lines, seed=0)
    a, b, c = w.requests
    assert a.num_prompt_tokens == 576
    assert b.num_prompt_tokens == 320
    assert c.num_prompt_tokens == 512
    assert a.prompt_token_ids[:256] == b.prompt_token_ids[:256]  # the group's run
    assert a.prompt_token_ids[256:512] != b.prompt_token_ids[256:]  # b's suffix is its own
    assert a.prompt_token_ids[:64] != c.prompt_token_ids[:64]  # another group
    assert (c.session_id, c.priority, c.cache_salt, c.tag) == ("s", 3, "t1", "sys")
    assert parse_trace(lines, seed=0) == w  # deterministic
    assert parse_trace(lines, seed=1).requests[0].prompt_token_ids != a.prompt_token_ids


def test_default_ids_come_from_line_numbers() -> None:
    w = parse_trace(['{"arrival_s": 0, "prompt_tokens": [1, 2, 3], "output_len": 2}'])
    assert w.requests[0].request_id == "line-1"


_GOOD = {"arrival_s": 0.0, "prompt_tokens": [1, 2, 3], "output_len": 4}


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (json.dumps({**_GOOD, "colour": "red"}), "unknown field"),
        (json.dumps({"prompt_tokens": [1], "output_len": 1}), "missing required field 'arrival_s'"),
        (json.dumps({**_GOOD, "arrival_s": -1}), "arrival_s must be"),
        (json.dumps({**_GOOD, "arrival_s": "soon"}), "arrival_s must be a number"),
        (json.dumps({**_GOOD, "output_len": 0}), "output_len must be >= 1"),
        (json.dumps({**_GOOD, "output_len": 2.5}), "output_len must be an integer"),
        (json.dumps({**_GOOD, "prompt_tokens": []}), "non-empty list"),
        (json.dumps({**_GOOD, "prompt_tokens": [1, "x"]}), "token ids are ints"),
        (json.dumps({**_GOOD, "prompt_tokens": [-3]}), "token ids are ints"),
        (json.dumps({"arrival_s": 0, "output_len": 1}), "no prompt"),
        (json.dumps({**_GOOD, "prefix_group": "g", "prefix_len": 4}), "not both"),
        (
            json.dumps({"arrival_s": 0, "output_len": 1, "prefix_group": "g", "prefix_len": 0}),
            "prompt is empty",
        ),
        (json.dumps({"arrival_s": 0, "output_len": 1, "prefix_len": 4}), "prefix_group"),
        (json.dumps({**_GOOD, "output_tokens": [1]}), "output_tokens has 1"),
        (json.dumps({**_GOOD, "follows": "ghost"}), "no earlier line"),
        (json.dumps({**_GOOD, "priority": "high"}), "priority must be an integer"),
        (json.dumps({**_GOOD, "cache_salt": ""}), "cache_salt must be"),
        (json.dumps({**_GOOD, "tag": 7}), "tag must be"),
    ],
)
def test_bad_line_raises_with_its_line_number(line: str, fragment: str) -> None:
    good = json.dumps({**_GOOD, "request_id": "first"})
    with pytest.raises(InvalidRequestError, match=fragment) as err:
        parse_trace([good, "", line], name="t.jsonl")
    assert str(err.value).startswith("t.jsonl:3: ")


def test_follower_before_its_parent_and_duplicate_ids_are_rejected() -> None:
    parent = json.dumps({**_GOOD, "request_id": "p", "arrival_s": 5})
    early = json.dumps({**_GOOD, "request_id": "c", "arrival_s": 1, "follows": "p"})
    with pytest.raises(InvalidRequestError, match=r"t:2: arrival_s 1\.0 is before"):
        parse_trace([parent, early], name="t")
    with pytest.raises(InvalidRequestError, match="t:2: duplicate request_id 'p'"):
        parse_trace([parent, parent], name="t")


def test_empty_or_missing_trace_is_a_typed_error(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(InvalidRequestError, match="holds no requests"):
        load_trace(empty)
    with pytest.raises(InvalidRequestError, match="cannot read trace"):
        load_trace(tmp_path / "missing.jsonl")
