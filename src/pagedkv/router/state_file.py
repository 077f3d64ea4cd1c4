"""The router's engine membership on disk: engines added or removed at run time survive a restart.

``pagedkv router --engine-state-file PATH`` keeps the ``--engine`` (decode) engines' URLs in
``PATH`` as JSON, ``{"version": 1, "engines": ["http://HOST:PORT", ...]}``, rewritten whole on
every ``POST``/``DELETE /router/engines``: a temporary file in the same folder is written and
fsynced, then ``os.replace``\\ d over ``PATH`` and the folder fsynced, so a crash leaves the old
membership or the new one, never half of one. At start a present file is the membership (the
``--engine`` flags seed it only when it does not exist yet). A file that cannot be read or parsed
raises :class:`~pagedkv.errors.StateFileError` naming it; the router refuses to start unless
``--engine-state-on-error ignore`` says to start from ``--engine`` with a warning.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx

from pagedkv.errors import StateFileError

STATE_VERSION = 1


def parse_engine_url(value: object) -> str:
    """An engine base URL ``http(s)://HOST:PORT`` (no path), or ValueError naming the problem."""
    if not isinstance(value, str):
        raise ValueError("url must be a string")
    try:
        parsed = httpx.URL(value)
    except httpx.InvalidURL as exc:
        raise ValueError(f"{value!r} is not an http://HOST:PORT base URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host or parsed.path not in ("", "/"):
        raise ValueError(f"{value!r} is not an http://HOST:PORT base URL")
    return value.rstrip("/")


class EngineStateFile:
    """One JSON file holding the router's engine URLs; each save replaces it atomically."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> list[str] | None:
        """The saved engine URLs in order, or None when the file does not exist.

        Raises StateFileError (naming the file) if it cannot be read, is not JSON, has another
        version, or lists something that is not an engine base URL, or one URL twice."""
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as exc:
            raise StateFileError(f"engine state file {self.path} is unreadable: {exc}") from exc
        try:
            body = json.loads(text)
        except json.JSONDecodeError as exc:
            raise StateFileError(f"engine state file {self.path} is not JSON: {exc}") from exc
        if not isinstance(body, dict) or body.get("version") != STATE_VERSION:
            raise StateFileError(
                f"engine state file {self.path} is not a version {STATE_VERSION} state "
                f'({{"version": {STATE_VERSION}, "engines": [...]}})'
            )
        engines = body.get("engines")
        if not isinstance(engines, list):
            raise StateFileError(f"engine state file {self.path}: 'engines' must be a list")
        try:
            urls = [parse_engine_url(u) for u in engines]
        except ValueError as exc:
            raise StateFileError(f"engine state file {self.path}: {exc}") from exc
        if len(set(urls)) != len(urls):
            raise StateFileError(f"engine state file {self.path} lists an engine twice: {urls}")
        return urls

    def save(self, urls: Sequence[str]) -> None:
        """Replace the file with ``urls``; on failure (StateFileError) the old file is intact."""
        data = json.dumps({"version": STATE_VERSION, "engines": list(urls)}, indent=1) + "\n"
        folder = self.path.parent
        tmp: str | None = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", suffix=".tmp", dir=folder)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
            tmp = None
            dir_fd = os.open(folder, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise StateFileError(f"cannot write engine state file {self.path}: {exc}") from exc
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
