"""benchmarks/grind_decode.py reads cachegrind's summary exactly (the run itself needs valgrind
and minutes; the merger's machine runs it by hand)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "grind_decode.py"

SUMMARY = """\
==28228== Command: python grind_decode.py --payload 64 0
--28228-- warning: L3 cache found, using its data for the LL simulation.
==28228== I   refs:      946,024,786
==28228== I1  misses:      9,983,605
==28228== LLi misses:         25,210
==28228== I1  miss rate:        1.06%
==28228== D   refs:      424,835,803  (283,218,216 rd   + 141,617,587 wr)
==28228== D1  misses:      9,217,299  (  7,834,557 rd   +   1,382,742 wr)
==28228== LLd misses:        369,116  (     92,158 rd   +     276,958 wr)
==28228== LL refs:        19,200,909  ( 17,818,167 rd   +   1,382,742 wr)
==28228== LL misses:         394,326  (    117,368 rd   +     276,958 wr)
==28228== LL miss rate:          0.0% (        0.0%     +         0.2%  )
"""


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grind_decode", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("grind_decode", mod)
    spec.loader.exec_module(mod)
    return mod


def test_parse_summary_takes_each_total_and_not_its_split_or_rate() -> None:
    assert _module().parse_summary(SUMMARY) == {
        "I refs": 946_024_786,
        "D refs": 424_835_803,
        "D1 misses": 9_217_299,
        "LL misses": 394_326,
    }


def test_parse_summary_of_output_without_a_summary_raises() -> None:
    text = SUMMARY.replace("==28228== LL misses:         394,326", "")
    with pytest.raises(RuntimeError, match="no cachegrind summary"):
        _module().parse_summary(text)
