"""JSONL request traces: one request per line (see docs/trace-format.md).

A line gives its prompt either as explicit token ids (``prompt_tokens``) or as a prefix-group
structure (``prefix_group`` + ``prefix_len`` + ``suffix_len``) that expands deterministically:
the prefix is the first ``prefix_len`` ids of the group's token run (so every line of a group
shares them, and a shorter prefix is a prefix of a longer one) and the suffix is a run named by
the request id (unique to the request). The same file and seed always give the same tokens.

Every problem is an InvalidRequestError naming the file and line: a trace is user input.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from pagedkv.errors import InvalidRequestError
from pagedkv.sim.workload import SimRequest, Workload, token_run

_FIELDS = frozenset(
    {
        "request_id",
        "arrival_s",
        "prompt_tokens",
        "prefix_group",
        "prefix_len",
        "suffix_len",
        "output_len",
        "output_tokens",
        "max_tokens",
        "session_id",
        "priority",
        "cache_salt",
        "follows",
        "think_s",
        "tag",
    }
)
_GROUP_FIELDS = ("prefix_group", "prefix_len", "suffix_len")


class _LineError(Exception):
    """A problem in one line; the loader adds the file and line number."""


def _int(obj: dict[str, Any], key: str, *, minimum: int, default: int | None = None) -> int:
    value = obj.get(key, default)
    if value is None:
        raise _LineError(f"missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int):
        raise _LineError(f"{key} must be an integer, got {value!r}")
    if value < minimum:
        raise _LineError(f"{key} must be >= {minimum}, got {value}")
    return value


def _float(obj: dict[str, Any], key: str, *, default: float | None = None) -> float:
    value = obj.get(key, default)
    if value is None:
        raise _LineError(f"missing required field {key!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _LineError(f"{key} must be a number, got {value!r}")
    if not (math.isfinite(value) and value >= 0):
        raise _LineError(f"{key} must be a finite number >= 0, got {value!r}")
    return float(value)


def _str(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise _LineError(f"{key} must be a non-empty string, got {value!r}")
    return value


def _tokens(obj: dict[str, Any], key: str) -> tuple[int, ...]:
    value = obj[key]
    if not isinstance(value, list) or not value:
        raise _LineError(f"{key} must be a non-empty list of token ids")
    for t in value:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < 2**31:
            raise _LineError(f"{key} holds {t!r}; token ids are ints in [0, 2**31)")
    return tuple(value)


def parse_line(obj: Any, default_id: str, seed: int) -> SimRequest:
    """One decoded JSON line -> a request. Raises _LineError (the loader adds the location)."""
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise _LineError(
            f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(_FIELDS))}"
        )
    rid = _str(obj, "request_id") or default_id
    has_group = [k for k in _GROUP_FIELDS if k in obj]
    if "prompt_tokens" in obj:
        if has_group:
            raise _LineError(f"give prompt_tokens or {'/'.join(_GROUP_FIELDS)}, not both")
        prompt = _tokens(obj, "prompt_tokens")
    elif has_group:
        group = _str(obj, "prefix_group")
        if group is None:
            raise _LineError("missing required field 'prefix_group'")
        prefix_len = _int(obj, "prefix_len", minimum=0)
        suffix_len = _int(obj, "suffix_len", minimum=0, default=0)
        if prefix_len + suffix_len == 0:
            raise _LineError("prefix_len + suffix_len is 0: the prompt is empty")
        prompt = tuple(
            token_run(seed, f"group/{group}", prefix_len)
            + token_run(seed, f"suffix/{rid}", suffix_len)
        )
    else:
        raise _LineError("no prompt: give prompt_tokens, or prefix_group with prefix_len")
    output_len = _int(obj, "output_len", minimum=1)
    output = _tokens(obj, "output_tokens") if "output_tokens" in obj else None
    if output is not None and len(output) != output_len:
        raise _LineError(f"output_tokens has {len(output)} ids but output_len is {output_len}")
    max_tokens = _int(obj, "max_tokens", minimum=1) if "max_tokens" in obj else None
    priority = obj.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise _LineError(f"priority must be an integer, got {priority!r}")
    return SimRequest(
        request_id=rid,
        arrival_s=_float(obj, "arrival_s"),
        prompt_token_ids=prompt,
        output_len=output_len,
        session_id=_str(obj, "session_id") or "",
        priority=priority,
        cache_salt=_str(obj, "cache_salt"),
        follows=_str(obj, "follows"),
        think_s=_float(obj, "think_s", default=0.0),
        output_token_ids=output,
        tag=_str(obj, "tag") or "",
        max_tokens=max_tokens,
    )


def parse_trace(lines: Iterable[str], *, name: str = "trace", seed: int = 0) -> Workload:
    """Parse JSONL text (blank lines are skipped). Errors name ``name`` and the line number."""
    reqs: list[SimRequest] = []
    arrival: dict[str, float] = {}
    for lineno, raw in enumerate(lines, start=1):
        line = raw.strip()
        if not line:
            continue
        where = f"{name}:{lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(f"{where}: not valid JSON ({exc.msg})") from None
        try:
            req = parse_line(obj, f"line-{lineno}", seed)
        except _LineError as exc:
            raise InvalidRequestError(f"{where}: {exc}") from None
        except InvalidRequestError as exc:  # SimRequest's own checks
            raise InvalidRequestError(f"{where}: {exc}") from None
        if req.request_id in arrival:
            raise InvalidRequestError(f"{where}: duplicate request_id {req.request_id!r}")
        if req.follows is not None:
            parent = arrival.get(req.follows)
            if parent is None:
                raise InvalidRequestError(
                    f"{where}: follows {req.follows!r}, which no earlier line defines"
                )
            if req.arrival_s < parent:
                raise InvalidRequestError(
                    f"{where}: arrival_s {req.arrival_s} is before that of {req.follows!r} "
                    f"({parent}), the request it follows"
                )
        arrival[req.request_id] = req.arrival_s
        reqs.append(req)
    if not reqs:
        raise InvalidRequestError(f"{name}: the trace holds no requests")
    return Workload(name, tuple(reqs))


def load_trace(path: str | Path, *, seed: int = 0) -> Workload:
    """Read a JSONL trace file; the workload is named after the file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidRequestError(f"cannot read trace {p}: {exc.strerror or exc}") from None
    return parse_trace(text.splitlines(), name=p.name, seed=seed)


def request_to_json(req: SimRequest) -> dict[str, Any]:
    """One request as a trace line's object (explicit tokens; defaults left out)."""
    obj: dict[str, Any] = {
        "request_id": req.request_id,
        "arrival_s": req.arrival_s,
        "prompt_tokens": list(req.prompt_token_ids),
        "output_len": req.output_len,
    }
    if req.session_id:
        obj["session_id"] = req.session_id
    if req.priority:
        obj["priority"] = req.priority
    if req.cache_salt is not None:
        obj["cache_salt"] = req.cache_salt
    if req.follows is not None:
        obj["follows"] = req.follows
    if req.think_s:
        obj["think_s"] = req.think_s
    if req.tag:
        obj["tag"] = req.tag
    if req.max_tokens is not None:
        obj["max_tokens"] = req.max_tokens
    if req.output_token_ids is not None:
        obj["output_tokens"] = list(req.output_token_ids)
    return obj


def save_trace(workload: Workload, path: str | Path) -> None:
    """Write ``workload`` as JSONL with explicit token ids (``load_trace`` gives it back)."""
    lines = [json.dumps(request_to_json(r), separators=(",", ":")) for r in workload.requests]
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
