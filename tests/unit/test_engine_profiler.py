"""``pagedkv profile``: the engine's steps are recorded with the shapes the scheduler gave them,
and the CSV they make is one ``pagedkv simulate --profile`` fits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagedkv.cli import main as pagedkv_main
from pagedkv.engine import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.profiler import profile_engine
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.errors import InvalidRequestError
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
    prefills = [r[:5] for r in rows if r[0]]
    # totals as step_totals counts them: causal pairs n(n+1)/2 per prompt, one sampled row each
    assert prefills == [
        (8, 0, 8, 36, 1),
        (24, 0, 24, 3 * 36, 3),
        (32, 0, 32, 528, 1),
        (96, 0, 96, 3 * 528, 3),
    ]
    first_decode = rows[1]
    assert first_decode[:5] == (0, 1, 9, 9, 1)  # 8 prompt tokens + the first output
    assert all(r[5] > 0 for r in rows)


def test_repeats_keep_one_row_per_step_with_its_median_time(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m")
    engine = LLMEngine.from_model_dir(str(model), EngineConfig(enable_prefix_caching=False))
    try:
        once = profile_engine(engine, prompt_lens=(8,), batch_sizes=(2,), max_tokens=3)
        thrice = profile_engine(engine, prompt_lens=(8,), batch_sizes=(2,), max_tokens=3, repeats=3)
        with pytest.raises(InvalidRequestError, match="repeats"):
            profile_engine(engine, repeats=0)
    finally:
        engine.close()
    assert [r[:5] for r in thrice] == [r[:5] for r in once]  # the same steps, not 3x as many
    assert all(r[5] > 0 for r in thrice)


def test_profile_command_writes_a_csv_simulate_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_tiny_model(tmp_path / "m")
    out = tmp_path / "p.csv"
    argv = ["profile", "--model", str(model), "--out", str(out), "--prompt-lens", "8,64"]
    before = torch.get_num_threads()
    assert pagedkv_main([*argv, "--batch-sizes", "1,4", "--max-tokens", "4", "--clock", "cpu"]) == 0
    assert torch.get_num_threads() == before  # --clock cpu ran on 1 thread, then restored it
    printed = capsys.readouterr().out
    assert "wrote 16 steps" in printed
    assert "R^2" in printed
    assert out.read_text().splitlines()[1].startswith("8,0,8,")  # the first group's prefill
    assert load_profile(out).num_rows == 16  # what simulate --profile reads
