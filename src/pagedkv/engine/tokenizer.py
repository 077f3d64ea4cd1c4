"""Tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, chat templates rendered with
a sandboxed jinja2 environment, and incremental detokenization for streaming."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from pagedkv.errors import InvalidRequestError, ModelLoadError


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class Tokenizer:
    """Encode, decode and apply the chat template of one model folder."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelLoadError(f"no tokenizer.json in {path}")
        try:
            self._tok = HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # the library raises a bare Exception on bad files
            raise ModelLoadError(f"cannot read {tok_file}: {exc}") from exc
        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise ModelLoadError(f"cannot read {cfg_file}: {exc}") from exc
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = (
            None if self.eos_token is None else self._tok.token_to_id(self.eos_token)
        )
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def to_json(self) -> str:
        """The serialized ``tokenizer.json`` (for the structured-output grammar engine)."""
        return str(self._tok.to_str())

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes, which may be part of a UTF-8 character (OpenAI's logprobs
        ``bytes``): a byte-level BPE piece is mapped back through GPT-2's byte alphabet."""
        text = self._tok.decode([token_id], skip_special_tokens=False)
        if "\ufffd" not in text:
            return text.encode()
        piece = self._tok.id_to_token(token_id) or ""
        table = _byte_alphabet()
        if piece and all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return text.encode()

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render the model's chat template; raises InvalidRequestError when there is none or
        it fails on these messages."""
        if self.chat_template is None:
            raise InvalidRequestError("this model's tokenizer_config.json has no chat_template")
        try:
            tmpl = self._env.from_string(self.chat_template)
            return tmpl.render(
                messages=list(messages),
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                raise_exception=_raise,
                tools=None if tools is None else list(tools),
            )
        except TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}") from exc


@functools.cache
def _byte_alphabet() -> dict[str, int]:
    """GPT-2's printable stand-in for each byte (byte-level BPE pieces), reversed."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += list(range(ord("®"), ord("ÿ") + 1))
    table = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def _raise(message: str) -> None:
    raise InvalidRequestError(f"chat template rejected the messages: {message}")


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without re-decoding everything.

    Decodes a short window (``prefix_offset``..end) and emits what extends the already-emitted
    text of the window, holding back while the tail is an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = list(prompt_token_ids)
        self._prefix_offset = max(0, len(self.token_ids) - 5)
        self._read_offset = len(self.token_ids)
        self.text = ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new text they complete (maybe empty)."""
        self.token_ids.extend(token_ids)
        skip = self._skip
        window = self.token_ids[self._prefix_offset : self._read_offset]
        prefix = self._tok.decode(window, skip_special_tokens=skip)
        full = self._tok.decode(self.token_ids[self._prefix_offset :], skip_special_tokens=skip)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""
