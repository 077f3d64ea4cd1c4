"""Chat templates: where a checkpoint keeps its template, and rendering it as transformers does.

Where a template comes from, first found wins (transformers' order)::

    --chat-template / LLM(chat_template=...)   a file path, or an inline Jinja string (as vLLM)
    <model>/chat_template.jinja                written by transformers >= 4.43's save_pretrained
    <model>/chat_template.json                 the processors' legacy {"chat_template": ...}
    <model>/tokenizer_config.json              "chat_template": a string, or named templates
                                               (the one named "default")

The environment matches ``transformers.utils.chat_template_utils``: a sandbox
(``ImmutableSandboxedEnvironment``), ``trim_blocks`` and ``lstrip_blocks``, the loop-controls
extension (``{% break %}``, ``{% continue %}``), a ``tojson`` filter that keeps non-ASCII text
(``ensure_ascii=False``) and takes ``indent``/``separators``/``sort_keys``, and the globals
``raise_exception``, ``strftime_now``. The special tokens (``bos_token``, ``eos_token``,
``unk_token``, ``pad_token``, ...) are variables, as transformers passes its
``special_tokens_map``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2.ext
from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pagedkv.errors import InvalidRequestError, ModelLoadError

CHAT_TEMPLATE_FILE = "chat_template.jinja"
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_JINJA_CHARS = "{}\n"


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """A template's text and where it came from (``source`` is shown at start-up)."""

    text: str
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.text, str) or not self.text:
            raise ModelLoadError(f"chat template from {self.source} is empty or not a string")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _pick(value: Any, source: str) -> ChatTemplate | None:
    """A template value of a JSON file: a string, or a list of {"name", "template"}."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is None:
        return None
    if not isinstance(value, str):
        raise ModelLoadError(f"chat_template in {source} is a {type(value).__name__}, not text")
    return ChatTemplate(value, source)


def find_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The template a model folder ships, in transformers' order; None when it has none.
    An unreadable file raises ModelLoadError (never skipped: a template a user shipped is
    never silently replaced by another)."""
    path = Path(model_dir)
    jinja = path / CHAT_TEMPLATE_FILE
    if jinja.is_file():
        try:
            return ChatTemplate(jinja.read_text(encoding="utf-8"), CHAT_TEMPLATE_FILE)
        except (OSError, UnicodeDecodeError) as exc:
            raise ModelLoadError(f"cannot read {jinja}: {exc}") from exc
    legacy = path / LEGACY_CHAT_TEMPLATE_FILE
    if legacy.is_file():
        raw = _read_json(legacy)
        found = _pick(raw.get("chat_template") if isinstance(raw, dict) else None, legacy.name)
        if found is not None:
            return found
    cfg = path / TOKENIZER_CONFIG_FILE
    if cfg.is_file():
        raw = _read_json(cfg)
        if isinstance(raw, dict):
            return _pick(raw.get("chat_template"), cfg.name)
    return None


def load_chat_template(value: str | Path) -> ChatTemplate:
    """``--chat-template``'s value, as vLLM reads it: the path of a file holding the template,
    else (when it holds a Jinja character: ``{``, ``}`` or a newline) the template itself, with
    backslash escapes such as ``\\n`` decoded. Anything else is a path that does not exist:
    InvalidRequestError."""
    text = str(value)
    path = Path(text).expanduser()
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a name too long for a path, a NUL byte: not a file
        is_file = False
    if is_file:
        if path.suffix == ".json":  # a chat_template.json or a tokenizer_config.json
            raw = _read_json(path)
            found = _pick(raw.get("chat_template") if isinstance(raw, dict) else None, str(path))
            if found is None:
                raise InvalidRequestError(f"{path} has no chat_template entry")
            return found
        try:
            return ChatTemplate(path.read_text(encoding="utf-8"), str(path))
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(f"cannot read the chat template {path}: {exc}") from exc
    if not any(c in text for c in _JINJA_CHARS):
        raise InvalidRequestError(
            f"chat template {text!r} is neither a file nor a template (no '{{', '}}' or newline)"
        )
    # backslash escapes typed on a command line; non-ASCII characters pass through unchanged
    decoded = text.encode("latin-1", "backslashreplace").decode("unicode_escape")
    return ChatTemplate(decoded, "--chat-template (inline)")


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_ENV = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
)
_ENV.filters["tojson"] = _tojson
_ENV.globals["raise_exception"] = _raise_exception
_ENV.globals["strftime_now"] = _strftime_now
_COMPILED: dict[str, Template] = {}  # template text -> compiled (templates are few and small)


def compile_template(text: str, source: str = "chat template") -> Template:
    """Compile once per distinct text; a syntax error is a ModelLoadError naming the source."""
    tmpl = _COMPILED.get(text)
    if tmpl is None:
        try:
            tmpl = _ENV.from_string(text)
        except TemplateError as exc:
            raise ModelLoadError(
                f"the chat template from {source} does not compile: {exc}"
            ) from exc
        _COMPILED[text] = tmpl
    return tmpl


def render_chat_template(
    template: ChatTemplate,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: Mapping[str, str] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **template_kwargs: Any,
) -> str:
    """Render like ``tokenizer.apply_chat_template(messages, tokenize=False)``. A template that
    fails on these messages (``raise_exception`` included) raises InvalidRequestError."""
    tmpl = compile_template(template.text, template.source)
    variables: dict[str, Any] = dict(special_tokens or {})
    variables.update(template_kwargs)
    try:
        return tmpl.render(
            messages=[dict(m) for m in messages],
            tools=None if tools is None else [dict(t) for t in tools],
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except TemplateError as exc:
        raise InvalidRequestError(f"chat template failed on these messages: {exc}") from exc
