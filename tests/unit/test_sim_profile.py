"""Fitting step costs to measured steps: the fit recovers known coefficients, stays >= 0, and
refuses a profile it cannot fit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pagedkv.errors import InvalidRequestError
from pagedkv.sched.output import ScheduledRequest, SchedulerOutput
from pagedkv.sim.cli import main
from pagedkv.sim.cost_model import step_totals
from pagedkv.sim.profile import (
    COLUMNS,
    FittedCost,
    fit_profile,
    load_profile,
    parse_profile,
    write_profile,
)

TRUE = (4e-3, 30e-6, 50e-6, 25e-9)  # per step, prefill token, decode seq, context token
TRUE6 = (*TRUE, 2e-9, 120e-6)  # ... attention pair, logit row


def _rows(n: int, noise: float, seed: int = 0) -> list[tuple[int, int, int, float]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        prefill = int(rng.integers(0, 2048)) if rng.random() < 0.5 else 0
        decodes = int(rng.integers(1, 128))
        context = int(rng.integers(decodes, decodes * 4000))
        t = TRUE[0] + TRUE[1] * prefill + TRUE[2] * decodes + TRUE[3] * context
        out.append((prefill, decodes, context, t * (1 + noise * rng.standard_normal())))
    return out


def test_fit_recovers_exact_coefficients(tmp_path: Path) -> None:
    path = tmp_path / "p.csv"
    write_profile(_rows(40, 0.0), path)
    fit = load_profile(path)
    got = (
        fit.cost.per_step_s,
        fit.cost.per_prefill_token_s,
        fit.cost.per_decode_seq_s,
        fit.cost.per_context_token_s,
    )
    assert got == pytest.approx(TRUE, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)
    assert fit.max_relative_error < 1e-6


def test_fit_with_two_percent_noise_stays_close() -> None:
    lines = ["num_prefill_tokens,num_decode_seqs,num_context_tokens,step_s"]
    lines += [f"{p},{d},{c},{t}" for p, d, c, t in _rows(400, 0.02, seed=1)]
    fit = fit_profile(parse_profile(lines))
    assert fit.cost.per_prefill_token_s == pytest.approx(TRUE[1], rel=0.03)
    assert fit.cost.per_context_token_s == pytest.approx(TRUE[3], rel=0.05)
    assert fit.r2 > 0.99


def test_a_coefficient_the_data_drives_negative_is_clipped_to_zero() -> None:
    rows = [(p, d, c, 1e-3 + 1e-5 * p - 1e-9 * c) for p, d, c, _ in _rows(50, 0.0)]
    fit = fit_profile(
        parse_profile(
            [
                "num_prefill_tokens,num_decode_seqs,num_context_tokens,step_s",
                *(f"{p},{d},{c},{max(t, 1e-4)}" for p, d, c, t in rows),
            ]
        )
    )
    assert fit.cost.per_context_token_s == 0.0
    assert fit.cost.per_prefill_token_s > 0.0


@pytest.mark.parametrize(
    ("lines", "fragment"),
    [
        (["a,b\n", "1,2\n"], "missing column"),
        (["num_prefill_tokens,num_decode_seqs,num_context_tokens,step_s", "1,2,x,0.1"], ":2:"),
        (["num_prefill_tokens,num_decode_seqs,num_context_tokens,step_s", "1,2,3,0.1"], "at least"),
    ],
)
def test_bad_profiles_are_refused(lines: list[str], fragment: str) -> None:
    with pytest.raises(InvalidRequestError, match=fragment):
        parse_profile(lines)


def test_a_column_that_never_varies_is_refused() -> None:
    rows = [(0, d, c, t) for _, d, c, t in _rows(20, 0.0)]
    header = "num_prefill_tokens,num_decode_seqs,num_context_tokens,step_s"
    with pytest.raises(InvalidRequestError, match="num_prefill_tokens is the same"):
        fit_profile(parse_profile([header, *(f"{p},{d},{c},{t}" for p, d, c, t in rows)]))


def test_cli_profile_is_used_instead_of_the_constants(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, js = tmp_path / "p.csv", tmp_path / "r.json"
    write_profile(_rows(40, 0.0), path)
    argv = ["--profile", str(path), "--num-requests", "12", "--compare", "caching=on", "--quiet"]
    assert main([*argv, "--json", str(js)]) == 0
    assert "fitted to 40 measured steps" in capsys.readouterr().out
    cost = json.loads(js.read_text())["base"]["cost"]
    assert cost["per_prefill_token_s"] == pytest.approx(TRUE[1], rel=1e-6)


def _sr(rid: str, start: int, num: int, *, prefill: bool, samples: bool) -> ScheduledRequest:
    empty = np.zeros(0, dtype=np.int32)
    return ScheduledRequest(rid, start, [0] * num, num, empty, empty, prefill, samples)


def _steps6(n: int, seed: int = 0) -> list[tuple[int, int, int, int, int]]:
    """Step totals as a chunked-prefill scheduler makes them (prefill chunks, some finishing so
    they sample, mixed with decodes), counted by the simulator's own step_totals."""
    rng = np.random.default_rng(seed)
    out = []
    for step in range(n):
        sched = [
            _sr(f"p{j}", int(rng.integers(0, 2048)), int(rng.integers(1, 512)), prefill=True,
                samples=bool(rng.random() < 0.5))
            for j in range(int(rng.integers(0, 3)))
        ]  # fmt: skip
        num_decodes = int(rng.integers(0 if sched else 1, 64))
        sched += [
            _sr(f"d{j}", int(rng.integers(1, 4000)), 1, prefill=False, samples=True)
            for j in range(num_decodes)
        ]
        out.append(step_totals(SchedulerOutput(step, sched, sum(s.num_tokens for s in sched))))
    return out


def _time6(totals: tuple[int, int, int, int, int]) -> float:
    return TRUE6[0] + sum(c * v for c, v in zip(TRUE6[1:], totals, strict=True))


def test_six_term_fit_recovers_known_coefficients_through_a_csv(tmp_path: Path) -> None:
    path = tmp_path / "p6.csv"
    write_profile([(*t, _time6(t)) for t in _steps6(80)], path)
    assert path.read_text().splitlines()[0] == ",".join(COLUMNS)
    fit = load_profile(path)
    c = fit.cost
    got = (
        c.per_step_s, c.per_prefill_token_s, c.per_decode_seq_s, c.per_context_token_s,
        c.per_attention_pair_s, c.per_logit_row_s,
    )  # fmt: skip
    assert got == pytest.approx(TRUE6, rel=1e-6)
    assert fit.r2 == pytest.approx(1.0)


def test_six_term_fit_with_noise_predicts_steps_the_four_term_model_cannot() -> None:
    """Prefill attention grows with (query, key) pairs, quadratic in a chunk: a cost with a
    pair term makes the four-term model misprice long chunks, the six-term fit does not."""
    rng = np.random.default_rng(3)
    steps = _steps6(300, seed=2)
    rows = np.asarray([(*t, _time6(t) * (1 + 0.02 * rng.standard_normal())) for t in steps])
    six = fit_profile(rows).cost
    four = fit_profile(rows[:, [0, 1, 2, 5]]).cost
    assert six.per_attention_pair_s == pytest.approx(TRUE6[4], rel=0.25)
    long_chunk = step_totals(
        SchedulerOutput(0, [_sr("p", 4000, 512, prefill=True, samples=True)], 512)
    )
    true = _time6(long_chunk)
    assert six.step_time(*long_chunk) == pytest.approx(true, rel=0.05)
    assert abs(four.step_time(*long_chunk) / true - 1) > 0.1


def test_fitted_cost_refuses_negative_or_all_zero_coefficients() -> None:
    with pytest.raises(InvalidRequestError, match="per_logit_row_s"):
        FittedCost(1e-3, 0.0, 0.0, 0.0, 0.0, -1.0)
    with pytest.raises(InvalidRequestError, match="every cost is 0"):
        FittedCost(0.0, 0.0, 0.0, 0.0)


def test_half_of_the_optional_columns_is_refused() -> None:
    header = "num_prefill_tokens,num_decode_seqs,num_context_tokens,num_logit_rows,step_s"
    with pytest.raises(InvalidRequestError, match="both or neither"):
        parse_profile([header, "1,2,3,4,0.1"])
