"""EngineStateFile: a saved engine list loads back; a bad file is refused naming it; a failed
save leaves the old file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedkv.errors import InvalidRequestError, StateFileError
from pagedkv.router.cli import resolve_engines
from pagedkv.router.state_file import EngineStateFile

A, B = "http://127.0.0.1:8001", "http://127.0.0.1:8002"


def test_saved_list_loads_back_in_order_and_leaves_no_temp_file(tmp_path: Path) -> None:
    state = EngineStateFile(tmp_path / "engines.json")
    assert state.load() is None  # absent: no saved list
    state.save([B, A])
    assert state.load() == [B, A]
    state.save([A])
    assert state.load() == [A]
    assert [p.name for p in tmp_path.iterdir()] == ["engines.json"]


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("{", "is not JSON"),
        ("[]", "not a version 1 state"),
        ('{"version": 2, "engines": []}', "not a version 1 state"),
        ('{"version": 1, "engines": "http://h:1"}', "'engines' must be a list"),
        ('{"version": 1, "engines": ["ftp://h:1"]}', "not an http://HOST:PORT base URL"),
        ('{"version": 1, "engines": [3]}', "url must be a string"),
        (json.dumps({"version": 1, "engines": [A, A + "/"]}), "lists an engine twice"),
    ],
)
def test_a_bad_file_is_refused_naming_it(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "engines.json"
    path.write_text(text)
    with pytest.raises(StateFileError, match=why) as info:
        EngineStateFile(path).load()
    assert str(path) in str(info.value)


def test_an_unreadable_file_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "engines.json"
    path.write_bytes(b"\xff\xfe")
    with pytest.raises(StateFileError, match="unreadable") as info:
        EngineStateFile(path).load()
    assert str(path) in str(info.value)


def test_a_failed_save_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "engines.json"
    path.mkdir()  # os.replace of a file over a folder fails
    with pytest.raises(StateFileError, match="cannot write"):
        EngineStateFile(path).save([A])
    assert path.is_dir()
    assert [p.name for p in tmp_path.iterdir()] == ["engines.json"]


def test_resolve_engines_prefers_the_saved_list_and_seeds_a_new_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = EngineStateFile(tmp_path / "engines.json")
    assert resolve_engines([A + "/"], state, "refuse") == [A]
    assert state.load() == [A]  # seeded at start
    state.save([B])
    assert resolve_engines([A], state, "refuse") == [B]  # the saved list wins
    state.path.write_text("{")
    with pytest.raises(StateFileError, match="is not JSON"):
        resolve_engines([A], state, "refuse")
    assert resolve_engines([A], state, "ignore") == [A]
    assert "warning: engine state file" in capsys.readouterr().err
    assert state.path.read_text() == "{"  # left for the operator until the next change
    with pytest.raises(InvalidRequestError, match="--engine"):
        resolve_engines(["http://h:1/v1"], state, "refuse")
