"""Chat messages to prompt token ids, where only the template writes control tokens.

A chat template puts role markers (``<|im_start|>``, ``<|user|>``, ...) around each message's
content. Rendering it to one string and tokenizing that string with special tokens parsed (what
transformers' ``apply_chat_template(tokenize=True)`` and vLLM do) also turns a marker a *user
typed* inside their content into the control token: a user can then close their own turn and
write a ``system`` turn. pagedkv does not: the text of a message's content is always tokenized
as plain text.

How: when no content contains a special token's text (the usual case) the rendered string is
tokenized as one piece, so the ids equal the usual ones exactly. Otherwise each such content is
replaced by a sentinel (private-use characters around a random nonce the user cannot guess)
before rendering; the rendered string is split at the sentinels, the template's pieces are
tokenized with specials parsed and each content with specials as plain text
(``Tokenizer.encode_plain``). A template that transforms the content (``| trim``) sees the
sentinel instead, so only those messages lose that transformation.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import InvalidRequestError

_TEMPLATE_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def encode_chat(
    tok: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """Prompt ids of ``messages`` under the model's chat template (see the module docstring).

    ``continue_final_message`` (vLLM's and transformers' option) ends the prompt right after
    the final message's content, so the model continues that message instead of starting a
    new one; ``chat_template_kwargs`` are extra template variables (``enable_thinking``, ...).
    Raises InvalidRequestError when the template is missing or rejects the messages, a content
    is not valid Unicode, or those two options cannot be honoured.
    """
    specials = tok.special_token_texts
    kwargs = _template_kwargs(
        tok, chat_template_kwargs, add_generation_prompt, continue_final_message
    )
    guarded = [
        i
        for i, m in enumerate(messages)
        if isinstance(m.get("content"), str) and any(s in m["content"] for s in specials)
    ]
    final = _final_content(messages) if continue_final_message else None
    if not guarded:
        text = tok.apply_chat_template(messages, tools=tools, **kwargs)
        if final is not None:
            text = _cut_after(text, final)
        return tok.encode(text, add_special_tokens=False)
    nonce = secrets.token_hex(8)
    marked = [dict(m) for m in messages]
    for i in guarded:
        marked[i]["content"] = f"\ue000{nonce}:{i}\ue001"
    text = tok.apply_chat_template(marked, tools=tools, **kwargs)
    if final is not None:
        last = len(messages) - 1
        text = _cut_after(text, marked[last]["content"] if last in guarded else final)
    ids: list[int] = []
    pos = 0
    for match in re.finditer(f"\ue000{nonce}:(\\d+)\ue001", text):
        ids += tok.encode(text[pos : match.start()], add_special_tokens=False)
        ids += tok.encode_plain(str(messages[int(match[1])]["content"]))
        pos = match.end()
    ids += tok.encode(text[pos:], add_special_tokens=False)
    return ids


def _template_kwargs(
    tok: Tokenizer,
    extra: Mapping[str, Any] | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> dict[str, Any]:
    """The template's variables besides messages and tools. Refused: both continuation
    options, a variable the server sets (``messages``, ``bos_token``, ...), and a string that
    holds a special token's text (the template would write it where specials are parsed)."""
    if continue_final_message and add_generation_prompt:
        raise InvalidRequestError(
            "continue_final_message and add_generation_prompt cannot both be true "
            "(set add_generation_prompt to false to continue the final message)"
        )
    extra = extra or {}
    clash = sorted(_TEMPLATE_RESERVED.union(tok.special_tokens).intersection(extra))
    if clash:
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(clash)}")
    specials = tok.special_token_texts
    if any(s in text for text in _strings(extra) for s in specials):
        raise InvalidRequestError("chat_template_kwargs may not hold a special token's text")
    return {**extra, "add_generation_prompt": add_generation_prompt}


def _strings(value: Any) -> list[str]:
    """Every string in a JSON-like value (keys of mappings included)."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def _final_content(messages: Sequence[Mapping[str, Any]]) -> str:
    content = messages[-1].get("content") if messages else None
    if not isinstance(content, str) or not content.strip():
        raise InvalidRequestError(
            "continue_final_message needs a final message with text content to continue"
        )
    return content


def _cut_after(text: str, final: str) -> str:
    """``text`` up to the end of the last occurrence of ``final`` (or of it stripped, for
    templates that trim contents, as transformers does)."""
    for piece in (final, final.strip()):
        at = text.rfind(piece)
        if at >= 0:
            return text[: at + len(piece)]
    raise InvalidRequestError(
        "continue_final_message: the chat template does not write the final message's "
        "content as given, so it cannot be continued"
    )
