"""``pagedkv profile``: the engine's steps are recorded with the shapes the scheduler gave them,
and the CSV they make is one ``pagedkv simulate --profile`` fits."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.cli import main as pagedkv_main
from pagedkv.engine import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.profiler import profile_engine
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.sim.profile import load_profile

pytestmark = pytest.mark.engine


def test_profile_rows_have_the_grid_shapes(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m")
    engine = LLMEngine.from_model_dir(str(model), EngineConfig(enable_prefix_caching=False))
    try:
        rows = profile_engine(engine, prompt_lens=(8, 32), batch_sizes=(1, 3), max_tokens=4)
        assert not engine.has_unfinished_requests()
    finally:
        engine.close()
    # per group: one prefill step (all prompts in one batch), then 3 decode steps
    assert len(rows) == 4 * 4
    prefills = [(p, d, c) for p, d, c, _ in rows if p]
    assert prefills == [(8, 0, 8), (24, 0, 24), (32, 0, 32), (96, 0, 96)]
    first_decode = rows[1]
    assert first_decode[:3] == (0, 1, 9)  # 8 prompt tokens + the first output
    assert all(t > 0 for *_, t in rows)


def test_profile_command_writes_a_csv_simulate_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_tiny_model(tmp_path / "m")
    out = tmp_path / "p.csv"
    argv = ["profile", "--model", str(model), "--out", str(out), "--prompt-lens", "8,64"]
    assert pagedkv_main([*argv, "--batch-sizes", "1,4", "--max-tokens", "4", "--clock", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "wrote 16 steps" in printed
    assert "R^2" in printed
    assert out.read_text().splitlines()[1].startswith("8,0,8,")  # the first group's prefill
    assert load_profile(out).num_rows == 16  # what simulate --profile reads
