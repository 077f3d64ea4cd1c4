"""The shared benchmark harness: warm-up, repeats, median and spread, a ``rich`` table, ``--json``.

Every number is a **time per operation** (one admission check, one block, one prompt), the
median over rounds; ``spread`` is ``(max - min) / median`` over those rounds, so a noisy row is
visible at a glance. Garbage collection is switched off while a round runs (as ``timeit`` does)
and a collection is forced before each measurement, so a collection triggered by set-up never
lands inside a timed round.

Clock: each round is timed with both the wall clock and the thread's CPU clock
(``CLOCK_THREAD_CPUTIME_ID``); tables report the CPU clock by default (``--clock wall`` for the
other). The code measured is single-threaded and never sleeps, so on an idle machine the two
agree; on a shared machine (other jobs on the same 2 cores) the CPU clock leaves out the time
the process spent descheduled, which otherwise turns into 10x outliers in 100 µs rounds. Both
are in the JSON.

Comparisons (a peer such as vLLM) are run in the same process, right after the baseline, and
printed as ``ratio = peer time / baseline time`` (above 1: the baseline is faster).

A benchmark describes what to time as :class:`Case` objects and :func:`run_cases` times them.
Two shapes cover every benchmark here:

* operations too fast to time one by one (an O(1) admission check): ``op`` is a *group* of
  calls (32 checks), a *round* times ``calls_per_round`` groups back to back, ``warmup`` groups
  run untimed first;
* operations that need untimed set-up and tear-down around each call (match + allocate a
  cached prompt, then free it): each call is one round, timed alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent


_CLOCKS = ("cpu", "wall")
_clock = "cpu"


def set_clock(name: str) -> None:
    """Choose the clock tables and medians use: ``"cpu"`` (default) or ``"wall"``."""
    global _clock
    if name not in _CLOCKS:
        raise ValueError(f"unknown clock {name!r}; choose one of {', '.join(_CLOCKS)}")
    _clock = name


@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds per operation for each round, and what they summarise to."""

    cpu_per_op_s: tuple[float, ...]  # one entry per round, thread CPU time
    wall_per_op_s: tuple[float, ...]  # the same rounds, wall-clock time
    ops_per_round: int
    clock: str = field(default_factory=lambda: _clock)

    @property
    def per_op_s(self) -> tuple[float, ...]:
        """Seconds per operation per round, on the chosen clock."""
        return self.cpu_per_op_s if self.clock == "cpu" else self.wall_per_op_s

    @property
    def median_s(self) -> float:
        return statistics.median(self.per_op_s)

    @property
    def min_s(self) -> float:
        return min(self.per_op_s)

    @property
    def max_s(self) -> float:
        return max(self.per_op_s)

    @property
    def spread(self) -> float:
        """``(max - min) / median`` over rounds (0.05 means the rounds span 5% of the median)."""
        med = self.median_s
        return (self.max_s - self.min_s) / med if med > 0 else 0.0


@dataclass(slots=True)
class Result:
    """One row of a benchmark table."""

    bench: str  # the fixture, e.g. "admission"
    case: str  # its parameters in words, e.g. "pages=8192 running=32"
    impl: str  # "pagedkv", or a peer's name
    unit: str  # what one operation is, e.g. "check", "block", "prompt"
    timing: Timing
    target_us: float | None = None  # the target per operation, if the issue set one
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    ratio: float | None = None  # this time / the baseline's time (peers only)

    @property
    def median_us(self) -> float:
        return self.timing.median_s * 1e6

    @property
    def meets_target(self) -> bool | None:
        return None if self.target_us is None else self.median_us <= self.target_us

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("timing")
        out.update(
            median_us=self.median_us,
            min_us=self.timing.min_s * 1e6,
            max_us=self.timing.max_s * 1e6,
            spread=self.timing.spread,
            clock=self.timing.clock,
            rounds_cpu_us=[t * 1e6 for t in self.timing.cpu_per_op_s],
            rounds_wall_us=[t * 1e6 for t in self.timing.wall_per_op_s],
            median_wall_us=statistics.median(self.timing.wall_per_op_s) * 1e6,
            ops_per_round=self.timing.ops_per_round,
            meets_target=self.meets_target,
        )
        return out


def _timed(fn: Callable[[], object]) -> tuple[int, int]:
    """(CPU, wall) nanoseconds one call of ``fn`` takes, with the collector off."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        fn()
        w1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        return c1 - c0, w1 - w0
    finally:
        if was_enabled:
            gc.enable()


def _timing(samples: list[tuple[int, int]], ops: int) -> Timing:
    return Timing(
        tuple(c / 1e9 / ops for c, _ in samples), tuple(w / 1e9 / ops for _, w in samples), ops
    )


@dataclass(slots=True)
class Case:
    """One thing to time, not yet timed: :func:`run_cases` turns it into a :class:`Result`.

    ``op`` performs ``ops`` operations per call. With ``setup``/``teardown`` (run untimed around
    every call) each call is a round; otherwise a round is ``calls_per_round`` back-to-back calls
    (for operations too fast to time one by one). ``warmup`` calls run untimed first. ``check``
    runs after timing and raises if the fixture did not do what it claims (a benchmark that
    silently measured a miss instead of a hit would be worse than none).
    """

    bench: str
    case: str
    impl: str
    unit: str
    op: Callable[[], object]
    ops: int = 1
    setup: Callable[[], object] | None = None
    teardown: Callable[[], object] | None = None
    calls_per_round: int = 1
    rounds: int = 5
    warmup: int = 5
    target_us: float | None = None
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    check: Callable[[], object] | None = None
    interleave: str = ""  # cases with the same key have their rounds interleaved

    def __post_init__(self) -> None:
        if min(self.ops, self.calls_per_round, self.rounds) <= 0 or self.warmup < 0:
            raise ValueError(f"{self.bench} {self.case}: ops, calls and rounds must be positive")
        if (self.setup or self.teardown) and self.calls_per_round != 1:
            raise ValueError(f"{self.bench} {self.case}: set-up needs one call per round")
        if not self.interleave:
            self.interleave = f"{self.bench}|{self.case}"


def _round_fn(case: Case) -> Callable[[], object]:
    if case.calls_per_round == 1:
        return case.op
    op, n = case.op, case.calls_per_round

    def one_round() -> None:
        for _ in range(n):
            op()

    return one_round


def _sample(case: Case, fn: Callable[[], object]) -> tuple[int, int]:
    if case.setup is not None:
        case.setup()
    ns = _timed(fn)
    if case.teardown is not None:
        case.teardown()
    return ns


def run_cases(cases: list[Case]) -> list[Result]:
    """Time every case; cases sharing an ``interleave`` key alternate round by round (case A
    round 1, case B round 1, A round 2, ...), so a burst of load on a shared machine hits the
    baseline and its peer alike. Returns results in the order of ``cases``."""
    samples: list[list[tuple[int, int]]] = [[] for _ in cases]
    keys: dict[str, list[int]] = {}
    for i, c in enumerate(cases):
        keys.setdefault(c.interleave, []).append(i)
    for members in keys.values():
        fns = {i: _round_fn(cases[i]) for i in members}
        for i in members:
            for _ in range(cases[i].warmup):
                _sample(cases[i], cases[i].op)
        gc.collect()
        for r in range(max(cases[i].rounds for i in members)):
            for i in members:
                if r < cases[i].rounds:
                    samples[i].append(_sample(cases[i], fns[i]))
        for i in members:
            check = cases[i].check
            if check is not None:
                check()
    return [
        Result(
            c.bench,
            c.case,
            c.impl,
            c.unit,
            _timing(s, c.ops * c.calls_per_round),
            c.target_us,
            c.params,
            c.note,
        )
        for c, s in zip(cases, samples, strict=True)
    ]


def add_ratios(results: list[Result], baseline: str = "pagedkv") -> None:
    """Set ``ratio`` on each non-baseline row that has a baseline row of the same bench and case."""
    base = {(r.bench, r.case): r for r in results if r.impl == baseline}
    for r in results:
        b = base.get((r.bench, r.case))
        if r.impl != baseline and b is not None and b.timing.median_s > 0:
            r.ratio = r.timing.median_s / b.timing.median_s


def flatness(results: Iterable[Result]) -> float:
    """``max / min`` of the medians of ``results`` (1.0 is perfectly flat)."""
    meds = [r.timing.median_s for r in results]
    return max(meds) / min(meds) if meds and min(meds) > 0 else float("nan")


def _fmt_us(us: float) -> str:
    if us >= 1000:
        return f"{us / 1000:,.2f} ms"
    if us >= 10:
        return f"{us:,.1f} µs"
    return f"{us:.3f} µs"


def print_table(title: str, results: list[Result], footer: Iterable[str] = ()) -> None:
    """Print ``results`` as a rich table (plain text when stdout is not a terminal)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for col, justify in (
        ("bench", "left"),
        ("case", "left"),
        ("impl", "left"),
        ("median / op", "right"),
        ("unit", "left"),
        ("wall median", "right"),
        ("spread", "right"),
        ("target", "right"),
        ("ratio", "right"),
        ("note", "left"),
    ):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in results:
        ok = r.meets_target
        target = "" if r.target_us is None else f"<= {_fmt_us(r.target_us)}"
        if ok is not None:
            target += " ok" if ok else " MISS"
        table.add_row(
            r.bench,
            r.case,
            r.impl,
            _fmt_us(r.median_us),
            r.unit,
            _fmt_us(statistics.median(r.timing.wall_per_op_s) * 1e6),
            f"{r.timing.spread:.0%}",
            target,
            "" if r.ratio is None else f"{r.ratio:.2f}x",
            r.note,
        )
    console = Console(width=max(200, Console().width))
    console.print(table)
    for line in footer:
        console.print(line)
    m = machine_info()
    console.print(
        f"clock: {_clock} (median / op, spread and ratio use it; spread = (max-min)/median "
        "over rounds; wall median is the same rounds on the wall clock); "
        f"machine: {m['cpu']}, {m['cores']} cores, load {m['load_average_1_5_15min']}, "
        f"Python {m['python']}, commit {m['commit']}"
    )


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, Python, commit."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    try:
        load: list[float] | None = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu": cpu,
        "load_average_1_5_15min": load,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "commit": commit or "unknown",
    }


def write_json(path: str, results: list[Result], extra: dict[str, Any] | None = None) -> None:
    """Write every row, the machine and the command line to ``path``."""
    doc = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "machine": machine_info(),
        "results": [r.to_json() for r in results],
        **(extra or {}),
    }
    Path(path).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def selected_fixtures(
    parser: argparse.ArgumentParser, args: argparse.Namespace, fixtures: Sequence[str]
) -> set[str]:
    """The fixtures ``--only`` names (all of them without it); an unknown name is a usage
    error (exit 2) that lists the choices."""
    only = set(args.only or fixtures)
    unknown = only - set(fixtures)
    if unknown:
        parser.error(f"unknown fixture(s) {sorted(unknown)}; choose from {', '.join(fixtures)}")
    return only


def base_parser(description: str) -> argparse.ArgumentParser:
    """The options every benchmark script takes."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a short run (smaller sizes, fewer rounds) for smoke tests",
    )
    p.add_argument(
        "--clock",
        choices=_CLOCKS,
        default="cpu",
        help="report thread CPU time (default; robust on a shared machine) or wall time",
    )
    p.add_argument(
        "--only",
        metavar="NAME",
        action="append",
        help="run only the named fixtures (repeatable)",
    )
    return p


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """Stop a server a benchmark started: SIGTERM, 20 s to drain, then SIGKILL."""
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)
