"""Environment variables pagedkv reads (this module is the only place that reads them).

| variable                    | effect                                                        |
|-----------------------------|---------------------------------------------------------------|
| PAGEDKV_CHECK_INVARIANTS=1  | the scheduler runs ``check_invariants()`` after every step     |
| PAGEDKV_API_KEY             | the server requires this Bearer token (``pagedkv serve``)      |
| PAGEDKV_CACHE_DIR           | where checkpoint fingerprints are cached (default              |
|                             | ``$XDG_CACHE_HOME/pagedkv``, else ``~/.cache/pagedkv``)        |
"""

from __future__ import annotations

import os
from pathlib import Path

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


def cache_dir() -> Path:
    """pagedkv's cache folder (it may not exist yet)."""
    explicit = env_str("PAGEDKV_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = env_str("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "pagedkv"
