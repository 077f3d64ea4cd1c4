"""Step costs fitted to measured steps (``pagedkv simulate --profile FILE.csv``).

The CSV has a header and one measured step a row::

    num_prefill_tokens,num_decode_seqs,num_context_tokens,step_s
    512,0,512,0.0214
    0,32,24000,0.0121

The four coefficients of :class:`~pagedkv.sim.cost_model.CostModel` (per step, per prefill
token, per decode sequence, per context token) are fitted by least squares, each kept >= 0
(a negative one is dropped and the rest refitted: a small active-set NNLS, so a noisy profile
cannot make a step cost less than nothing). Every column must vary across the rows, or its
coefficient could not be told apart from the constant: such a profile is refused.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv.errors import InvalidRequestError
from pagedkv.sim.cost_model import CostModel

COLUMNS = ("num_prefill_tokens", "num_decode_seqs", "num_context_tokens", "step_s")
MIN_ROWS = 8


@dataclass(frozen=True, slots=True)
class ProfileFit:
    """A fitted cost model and how well it fits: ``r2`` (1.0 is exact) and the largest
    relative error over the rows."""

    cost: CostModel
    num_rows: int
    r2: float
    max_relative_error: float


def parse_profile(lines: Iterable[str], *, name: str = "profile") -> np.ndarray:
    """CSV text -> an (n, 4) float array in :data:`COLUMNS` order; errors name the line."""
    reader = csv.DictReader(lines)
    missing = [c for c in COLUMNS if c not in (reader.fieldnames or ())]
    if missing:
        raise InvalidRequestError(f"{name}: missing column(s) {', '.join(missing)}")
    rows: list[list[float]] = []
    for lineno, row in enumerate(reader, start=2):
        try:
            values = [float(row[c]) for c in COLUMNS]
        except (TypeError, ValueError):
            raise InvalidRequestError(f"{name}:{lineno}: expected numbers, got {row}") from None
        if not all(np.isfinite(values)) or min(values) < 0:
            raise InvalidRequestError(f"{name}:{lineno}: values must be finite and >= 0")
        if values[0] == 0 and values[1] == 0:
            raise InvalidRequestError(f"{name}:{lineno}: a step with no tokens")
        rows.append(values)
    if len(rows) < MIN_ROWS:
        raise InvalidRequestError(f"{name}: {len(rows)} rows; a fit needs at least {MIN_ROWS}")
    return np.asarray(rows, dtype=np.float64)


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0: drop the most negative, refit, repeat."""
    active = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(x[:, active], y, rcond=None)
        if (sol >= 0).all():
            coef[active] = sol
            return coef
        active.pop(int(np.argmin(sol)))
    return coef


def fit_profile(data: np.ndarray) -> ProfileFit:
    """Fit ``step_s = a + b * prefill + c * decodes + d * context`` to measured rows.

    Columns are scaled to unit size before solving so tokens (thousands) and seconds
    (milliseconds) condition alike.
    """
    feats, y = data[:, :3], data[:, 3]
    for i, col in enumerate(COLUMNS[:3]):
        if np.ptp(feats[:, i]) == 0:
            raise InvalidRequestError(
                f"profile: {col} is the same in every row; measure steps that vary it"
            )
    x = np.column_stack([np.ones(len(y)), feats])
    scale = np.abs(x).max(axis=0)
    coef = _nnls(x / scale, y) / scale
    pred = x @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    rel = np.abs(pred - y) / np.maximum(y, 1e-12)
    cost = CostModel(
        per_step_s=float(coef[0]),
        per_prefill_token_s=float(coef[1]),
        per_decode_seq_s=float(coef[2]),
        per_context_token_s=float(coef[3]),
    )
    return ProfileFit(cost, len(y), 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0, float(rel.max()))


def load_profile(path: str | Path) -> ProfileFit:
    """Read and fit a profile CSV file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRequestError(f"cannot read profile {p}: {exc.strerror or exc}") from None
    return fit_profile(parse_profile(text.splitlines(), name=p.name))


def write_profile(rows: Iterable[tuple[int, int, int, float]], path: str | Path) -> None:
    """Write measured steps as a profile CSV (what :func:`load_profile` reads)."""
    lines = [",".join(COLUMNS)]
    lines += [f"{p},{d},{c},{t:.9g}" for p, d, c, t in rows]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
