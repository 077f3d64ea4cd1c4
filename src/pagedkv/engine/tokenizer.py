"""Tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, chat templates rendered with
a sandboxed jinja2 environment, and incremental detokenization for streaming."""

from __future__ import annotations

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
        self._plain: HFTokenizer | None = None  # specials as text; built on first use
        self._max_token_chars: int | None = None
        self._special_tokens: tuple[str, ...] | None = None

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size())

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special tokens written in it become their control ids.

        Runs through ``encode_batch``, which releases the GIL (``encode`` holds it: a 10 MB
        prompt would stall every other thread, the server's event loop included, for seconds).
        A lone surrogate (not UTF-8) raises InvalidRequestError.
        """
        check_utf8(text)
        enc = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(enc[0].ids)

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with special tokens written in it tokenized as plain text
        (``"<|user|>"`` typed by a user never becomes the control token)."""
        check_utf8(text)
        if self._plain is None:
            self._plain = HFTokenizer.from_str(self._tok.to_str())
            self._plain.encode_special_tokens = True
        return list(self._plain.encode_batch([text], add_special_tokens=False)[0].ids)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry (``"Ġhello"``, as transformers' ``convert_ids_to_tokens``)."""
        return [self._tok.id_to_token(int(t)) or "" for t in token_ids]

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The text of every special (control) token, longest first."""
        if self._special_tokens is None:
            added = self._tok.get_added_tokens_decoder().values()
            texts = {t.content for t in added if t.special}
            self._special_tokens = tuple(sorted(texts, key=len, reverse=True))
        return self._special_tokens

    @property
    def max_token_chars(self) -> int:
        """The most characters any single token decodes to (a bound on text per token)."""
        if self._max_token_chars is None:
            ids = list(range(self.vocab_size))
            pieces = self._tok.decode_batch([[i] for i in ids], skip_special_tokens=False)
            self._max_token_chars = max(1, *(len(p) for p in pieces))
        return self._max_token_chars

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
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
            )
        except TemplateError as exc:
            raise InvalidRequestError(f"chat template failed: {exc}") from exc


def check_utf8(text: str) -> None:
    """Raise InvalidRequestError when ``text`` is not valid Unicode (a lone surrogate, which
    JSON's ``\\ud800`` escape can carry)."""
    if text.isascii():
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"text holds a lone surrogate {text[exc.start]!r} at character {exc.start}; "
            "it is not valid Unicode"
        ) from None


def _raise(message: str) -> None:
    raise InvalidRequestError(f"chat template rejected the messages: {message}")


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without re-decoding everything.

    Decodes a short window (``prefix_offset``..end) and emits what extends the already-emitted
    text of the window, holding back while the tail is an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self.token_ids: list[int] = list(prompt_token_ids)
        self._prefix_offset = max(0, len(self.token_ids) - 5)
        self._read_offset = len(self.token_ids)
        self.text = ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; return the new text they complete (maybe empty)."""
        self.token_ids.extend(token_ids)
        prefix = self._tok.decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._tok.decode(self.token_ids[self._prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            self.text += delta
            return delta
        return ""
