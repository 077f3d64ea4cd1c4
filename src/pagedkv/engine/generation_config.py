"""A checkpoint's ``generation_config.json``: sampling defaults and extra end-of-sequence ids.

As vLLM (``--generation-config auto``, its default) and SGLang do, the file's sampling values
are the defaults of a request that leaves them unset; a value the request gives always wins.
Read: ``temperature``, ``top_p``, ``top_k``, ``repetition_penalty``, ``max_new_tokens`` (the
default ``max_tokens``) and ``eos_token_id`` (an id or a list: each stops generation, beside the
tokenizer's eos). ``do_sample`` is ignored, as vLLM ignores it: a file with ``do_sample: false``
and ``temperature: 0.6`` samples at 0.6.

``--generation-config vllm`` ignores the file (pagedkv's own defaults); a folder path reads that
folder's ``generation_config.json`` instead of the model's.

A default the sampler has no field for (``repetition_penalty`` until the sampler implements
penalties) is kept here and reported by :meth:`GenerationDefaults.unsupported`; the engine logs
a warning naming it once at load, so it is never dropped silently.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from pagedkv.engine.sampler import SamplingParams
from pagedkv.errors import InvalidRequestError, ModelLoadError

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Sampling defaults of one checkpoint; ``None`` means the file does not set it.

    ``source`` names where they came from (a file path, or ``"none"``).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    source: str = "none"

    def __post_init__(self) -> None:
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise ModelLoadError(f"{self.source}: max_new_tokens must be positive")

    def sampling_defaults(self) -> dict[str, Any]:
        """The set values the sampler implements, as ``SamplingParams`` keyword arguments."""
        values = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
            "max_tokens": self.max_tokens,
        }
        return {k: v for k, v in values.items() if v is not None and k in _SAMPLING_FIELDS}

    def unsupported(self) -> dict[str, Any]:
        """Set values the sampler has no field for (they are not applied)."""
        values = {"repetition_penalty": self.repetition_penalty}
        return {
            k: v
            for k, v in values.items()
            if v is not None and v != 1.0 and k not in _SAMPLING_FIELDS
        }

    def sampling_params(self, **request: Any) -> SamplingParams:
        """``SamplingParams`` from a request's values: a value that is ``None`` (unset) takes
        this checkpoint's default, then ``SamplingParams``' own."""
        merged = self.sampling_defaults()
        merged.update({k: v for k, v in request.items() if v is not None})
        return SamplingParams(**merged)


def load_generation_defaults(model_dir: str | Path, mode: str = "auto") -> GenerationDefaults:
    """Read the defaults for ``--generation-config MODE``: ``"auto"`` (the model folder's file,
    when it has one), ``"vllm"`` (none) or a folder holding a ``generation_config.json``.
    An unreadable or malformed file raises ModelLoadError."""
    if mode == "vllm":
        return GenerationDefaults(source="none (--generation-config vllm)")
    if mode == "auto":
        path = Path(model_dir) / GENERATION_CONFIG_FILE
        if not path.is_file():
            return GenerationDefaults()
    else:
        path = Path(mode) / GENERATION_CONFIG_FILE
        if not path.is_file():
            raise InvalidRequestError(f"--generation-config {mode}: no {GENERATION_CONFIG_FILE}")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return _parse(raw, str(path))


def _parse(raw: dict[str, Any], source: str) -> GenerationDefaults:
    def number(name: str, kind: type[float] | type[int]) -> Any:
        value = raw.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelLoadError(f"{source}: {name} must be a number, got {value!r}")
        if kind is int and value != int(value):
            raise ModelLoadError(f"{source}: {name} must be an integer, got {value!r}")
        return kind(value)

    eos = raw.get("eos_token_id")
    items = [] if eos is None else eos if isinstance(eos, list) else [eos]
    if any(isinstance(e, bool) or not isinstance(e, int) or e < 0 for e in items):
        raise ModelLoadError(f"{source}: eos_token_id must be an id or a list of ids, got {eos!r}")
    defaults = GenerationDefaults(
        temperature=number("temperature", float),
        top_p=number("top_p", float),
        top_k=number("top_k", int),
        repetition_penalty=number("repetition_penalty", float),
        max_tokens=number("max_new_tokens", int),
        eos_token_ids=tuple(sorted(set(items))),
        source=source,
    )
    try:  # the values must make valid SamplingParams, or every request would fail later
        defaults.sampling_params()
    except InvalidRequestError as exc:
        raise ModelLoadError(f"{source}: {exc}") from exc
    return defaults
