"""Step costs fitted to measured steps (``pagedkv simulate --profile FILE.csv``).

The CSV has a header and one measured step a row; the columns are the step's totals as
:func:`~pagedkv.sim.cost_model.step_totals` counts them, then its time::

    num_prefill_tokens,num_decode_seqs,num_context_tokens,num_attention_pairs,num_logit_rows,step_s
    512,0,512,131328,1,0.0214
    0,32,24000,24000,32,0.0121

``num_attention_pairs`` and ``num_logit_rows`` are optional (older profiles lack them); when
present both are fitted. The model (:class:`FittedCost`)::

    step_s = a + b * prefill tokens + c * decode seqs + d * context tokens
               + e * attention pairs + f * logit rows

Why these six: on pagedkv's CPU engine a step pays a fixed Python and scheduling cost (a), the
linear layers once per computed token (b for prefill positions, c for a decode's one position
plus its per-sequence bookkeeping), attention over each scheduled request's KV (d, the decode
gather dominates), prefill attention's causal (query, key) pairs (e, quadratic in a chunk) and
the LM head plus sampling once per sampled row (f). In a pure-decode step pairs equal context
and logit rows equal decodes, so (d, e) and (c, f) are only told apart by prefill steps; how the
fit splits them does not change a pure-decode step's price. Not expressible from these totals:
a context token read by a decode and one read by a prefill chunk costing differently (on the CPU
engine they do; d is then a compromise, the least stable coefficient over repeated profiles).

Coefficients are fitted by least squares on relative errors (each row weighted by 1 / its time:
steps span 3-40 ms and their noise grows with them, so the many short decode steps are not
outweighed by a few long prefills), each kept >= 0 (a negative one is dropped and the rest
refitted: a small active-set NNLS, so a noisy profile cannot make a step cost less than
nothing). Each of the first three columns must vary across the rows, or its coefficient could
not be told apart from the constant: such a profile is refused.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pagedkv.errors import InvalidRequestError

REQUIRED = ("num_prefill_tokens", "num_decode_seqs", "num_context_tokens")
OPTIONAL = ("num_attention_pairs", "num_logit_rows")
COLUMNS = (*REQUIRED, *OPTIONAL, "step_s")  # what write_profile writes
MIN_ROWS = 8
_FIELDS = (
    "per_step_s",
    "per_prefill_token_s",
    "per_decode_seq_s",
    "per_context_token_s",
    "per_attention_pair_s",
    "per_logit_row_s",
)


@dataclass(frozen=True, slots=True)
class FittedCost:
    """A step cost fitted to measurements: :class:`~pagedkv.sim.cost_model.CostModel`'s four
    coefficients plus one per causal attention pair and one per sampled row (all seconds, all
    >= 0; the last two are 0 for a profile without their columns)."""

    per_step_s: float
    per_prefill_token_s: float
    per_decode_seq_s: float
    per_context_token_s: float
    per_attention_pair_s: float = 0.0
    per_logit_row_s: float = 0.0

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0.0):
                raise InvalidRequestError(f"{name} must be a finite number >= 0, got {value}")
        if not any(getattr(self, name) for name in _FIELDS):
            raise InvalidRequestError("every cost is 0: simulated time would never advance")

    def step_time(
        self,
        num_prefill_tokens: int,
        num_decode_seqs: int,
        num_context_tokens: int = 0,
        num_attention_pairs: int = 0,
        num_logit_rows: int | None = None,
    ) -> float:
        """Seconds for one step with these totals (an empty step costs nothing);
        ``num_logit_rows=None`` counts one per decode."""
        if num_prefill_tokens == 0 and num_decode_seqs == 0:
            return 0.0
        rows = num_decode_seqs if num_logit_rows is None else num_logit_rows
        return (
            self.per_step_s
            + self.per_prefill_token_s * num_prefill_tokens
            + self.per_decode_seq_s * num_decode_seqs
            + self.per_context_token_s * num_context_tokens
            + self.per_attention_pair_s * num_attention_pairs
            + self.per_logit_row_s * rows
        )


@dataclass(frozen=True, slots=True)
class ProfileFit:
    """A fitted cost model and how well it fits: ``r2`` (1.0 is exact) and the largest
    relative error over the rows."""

    cost: FittedCost
    num_rows: int
    r2: float
    max_relative_error: float


def parse_profile(lines: Iterable[str], *, name: str = "profile") -> np.ndarray:
    """CSV text -> a float array, one row a step: the three required columns, the optional
    ones the header has (both or neither), then ``step_s``; errors name the line."""
    reader = csv.DictReader(lines)
    header = reader.fieldnames or ()
    missing = [c for c in (*REQUIRED, "step_s") if c not in header]
    if missing:
        raise InvalidRequestError(f"{name}: missing column(s) {', '.join(missing)}")
    extra = [c for c in OPTIONAL if c in header]
    if extra and len(extra) != len(OPTIONAL):
        raise InvalidRequestError(f"{name}: give both or neither of {', '.join(OPTIONAL)}")
    cols = (*REQUIRED, *extra, "step_s")
    rows: list[list[float]] = []
    for lineno, row in enumerate(reader, start=2):
        try:
            values = [float(row[c]) for c in cols]
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


def fit_profile(data: np.ndarray | Sequence[Sequence[float]]) -> ProfileFit:
    """Fit :class:`FittedCost` to measured rows: ``(n, 4)`` (the required columns, then
    ``step_s``) or ``(n, 6)`` (with the optional ones), as :func:`parse_profile` returns them.

    Columns are scaled to unit size before solving so tokens (thousands), pairs (millions)
    and seconds (milliseconds) condition alike.
    """
    arr = np.asarray(data, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] not in (len(REQUIRED) + 1, len(COLUMNS)):
        raise InvalidRequestError(
            f"profile: rows need {len(REQUIRED) + 1} or {len(COLUMNS)} columns, got {arr.shape}"
        )
    feats, y = arr[:, :-1], arr[:, -1]
    for i, col in enumerate(REQUIRED):
        if np.ptp(feats[:, i]) == 0:
            raise InvalidRequestError(
                f"profile: {col} is the same in every row; measure steps that vary it"
            )
    x = np.column_stack([np.ones(len(y)), feats])
    scale = np.maximum(np.abs(x).max(axis=0), 1e-300)
    w = 1.0 / np.maximum(y, 1e-12)[:, None]  # relative errors: a 3 ms step counts as a 30 ms one
    coef = _nnls(x / scale * w, y * w[:, 0]) / scale
    pred = x @ coef
    ss_res = float(((y - pred) ** 2).sum())
    ss_tot = float(((y - y.mean()) ** 2).sum())
    rel = np.abs(pred - y) / np.maximum(y, 1e-12)
    cost = FittedCost(*(float(c) for c in coef))
    return ProfileFit(cost, len(y), 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0, float(rel.max()))


def load_profile(path: str | Path) -> ProfileFit:
    """Read and fit a profile CSV file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRequestError(f"cannot read profile {p}: {exc.strerror or exc}") from None
    return fit_profile(parse_profile(text.splitlines(), name=p.name))


def write_profile(rows: Iterable[Sequence[float]], path: str | Path) -> None:
    """Write measured steps as a profile CSV (what :func:`load_profile` reads): rows of the
    three required totals and ``step_s``, or of all five totals and ``step_s``."""
    out: list[str] = []
    width = 0
    for row in rows:
        *totals, t = row
        if not out:
            width = len(row)
            if width not in (len(REQUIRED) + 1, len(COLUMNS)):
                raise InvalidRequestError(f"a profile row has 4 or 6 values, got {width}")
            out.append(",".join((*(*REQUIRED, *OPTIONAL)[: width - 1], "step_s")))
        elif len(row) != width:
            raise InvalidRequestError(f"profile rows of {width} and {len(row)} values mixed")
        out.append(",".join([*(str(int(v)) for v in totals), f"{t:.9g}"]))
    if not out:
        raise InvalidRequestError("no measured steps to write")
    Path(path).write_text("\n".join(out) + "\n", encoding="utf-8")
