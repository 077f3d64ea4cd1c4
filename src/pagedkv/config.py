"""Environment variables pagedkv reads (this module is the only place that reads them).

| variable                    | effect                                                        |
|-----------------------------|---------------------------------------------------------------|
| PAGEDKV_CHECK_INVARIANTS=1  | the scheduler runs ``check_invariants()`` after every step     |
| PAGEDKV_API_KEY             | the server requires this Bearer token (``pagedkv serve``)      |
"""

from __future__ import annotations

import os

_TRUE = {"1", "true", "yes", "on"}


def env_flag(name: str, default: bool = False) -> bool:
    """A boolean environment variable: 1/true/yes/on (any case) mean True."""
    value = os.environ.get(name)
    if value is None:
        return default
    return value.strip().lower() in _TRUE


def env_str(name: str) -> str | None:
    """A string environment variable, or None when unset or empty."""
    value = os.environ.get(name)
    return value or None


def check_invariants_default() -> bool:
    """Whether stateful components check their invariants after every step by default."""
    return env_flag("PAGEDKV_CHECK_INVARIANTS")
