"""The ``pagedkv`` dispatcher: usage, unknown commands, and user errors without tracebacks."""

from __future__ import annotations

import subprocess
import sys

from pagedkv.cli import main


def test_help_lists_every_command(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("simulate", "bench-core", "demo", "generate", "serve"):
        assert name in out


def test_unknown_command_exits_2(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_a_missing_model_folder_is_a_one_line_error_not_a_traceback(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for cmd in ("serve", "generate"):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "pagedkv.cli",
                cmd,
                "--model",
                str(tmp_path / "none"),
                *(["--prompt", "x"] if cmd == "generate" else []),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        said = " ".join((proc.stdout + proc.stderr).split())  # rich may wrap lines
        assert proc.returncode == 1, said  # a failure while running (usage errors: 2)
        assert "Traceback" not in said
        assert "does not exist" in said
