"""Tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, the checkpoint's chat
template (found and rendered by :mod:`pagedkv.engine.chat_template`), and incremental
detokenization for streaming."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from pagedkv.engine.chat_template import ChatTemplate, find_chat_template, render_chat_template
from pagedkv.errors import InvalidRequestError, ModelLoadError


def _token_text(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class Tokenizer:
    """Encode, decode and apply the chat template of one model folder."""

    def __init__(self, model_dir: str | Path, *, chat_template: ChatTemplate | None = None) -> None:
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
        self.chat_template: ChatTemplate | None = chat_template or find_chat_template(path)
        self.special_tokens = special_tokens_map(cfg)
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.eos_token_id = (
            None if self.eos_token is None else self._tok.token_to_id(self.eos_token)
        )
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
    def special_token_texts(self) -> tuple[str, ...]:
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
        **template_kwargs: Any,
    ) -> str:
        """Render the model's chat template (see :mod:`pagedkv.engine.chat_template`); raises
        InvalidRequestError when there is none or it fails on these messages."""
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model ships no chat template (chat_template.jinja, chat_template.json or "
                "tokenizer_config.json's chat_template); give one with --chat-template"
            )
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            **template_kwargs,
        )


def special_tokens_map(cfg: Mapping[str, Any]) -> dict[str, str]:
    """The special tokens of a ``tokenizer_config.json`` as template variables (transformers'
    ``special_tokens_map``: ``bos_token``, ``eos_token``, ... and the additional ones)."""
    out: dict[str, str] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        text = _token_text(cfg.get(name))
        if text is not None:
            out[name] = text
    return out


_SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


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
