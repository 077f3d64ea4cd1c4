"""Shared test set-up: make ``tests/`` importable so tests can use ``reference.*`` helpers; a
``threads`` fixture that runs a test at 1 and at 2 torch intra-op threads."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from collections.abc import Iterator  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402

# `pytest --hypothesis-profile=no-shrink`: report the first failure at once (for mutation checks).
settings.register_profile("no-shrink", phases=[Phase.explicit, Phase.reuse, Phase.generate])


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """The test at ``request.param`` torch threads (the kernels' thread splits), restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
