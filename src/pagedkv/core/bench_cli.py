"""``pagedkv bench-core``: run ``benchmarks/bench_core.py`` from a source checkout.

The benchmarks live beside the package in the repository (they import peers' trees and a shared
harness, and are not installed), so this command finds them relative to the source tree and runs
the script as ``__main__``, passing the remaining arguments through (``--quick``, ``--json
PATH``, ``--peer-vllm PATH``, ...; ``--help`` lists them).
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

_SCRIPT = Path("benchmarks") / "bench_core.py"


def find_script() -> Path | None:
    """``benchmarks/bench_core.py`` of the checkout this package was imported from, if any.

    In a checkout this file is ``<repo>/src/pagedkv/core/bench_cli.py``; an installed copy
    (site-packages) has no ``benchmarks`` folder three levels up, and gets None.
    """
    parents = Path(__file__).resolve().parents
    if len(parents) < 4:
        return None
    candidate = parents[3] / _SCRIPT
    return candidate if candidate.is_file() else None


def main(argv: list[str]) -> int:
    script = find_script()
    if script is None:
        print(
            f"pagedkv bench-core: {_SCRIPT} was not found above {Path(__file__).resolve().parent}. "
            "The benchmarks ship with the source repository, not the installed package: clone "
            "the repository, `pip install -e .` there, and run `pagedkv bench-core` (or "
            "`python benchmarks/bench_core.py`) from that checkout.",
            file=sys.stderr,
        )
        return 2
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [str(script), *argv]
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:  # the script (or argparse) exits with its status
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
    return 0
