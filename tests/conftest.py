"""Shared test set-up: make ``tests/`` importable so tests can use ``reference.*`` helpers."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from hypothesis import Phase, settings  # noqa: E402

# `pytest --hypothesis-profile=no-shrink`: report the first failure at once (for mutation checks).
settings.register_profile("no-shrink", phases=[Phase.explicit, Phase.reuse, Phase.generate])
