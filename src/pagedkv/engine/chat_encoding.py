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


def encode_chat(
    tok: Tokenizer,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> list[int]:
    """Prompt ids of ``messages`` under the model's chat template (see the module docstring).

    Raises InvalidRequestError when the template is missing or rejects the messages, or a
    content is not valid Unicode.
    """
    specials = tok.special_token_texts
    guarded = [
        i
        for i, m in enumerate(messages)
        if isinstance(m.get("content"), str) and any(s in m["content"] for s in specials)
    ]
    if not guarded:
        text = tok.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tools=tools
        )
        return tok.encode(text, add_special_tokens=False)
    nonce = secrets.token_hex(8)
    marked = [dict(m) for m in messages]
    for i in guarded:
        marked[i]["content"] = f"\ue000{nonce}:{i}\ue001"
    text = tok.apply_chat_template(marked, add_generation_prompt=add_generation_prompt, tools=tools)
    ids: list[int] = []
    pos = 0
    for match in re.finditer(f"\ue000{nonce}:(\\d+)\ue001", text):
        ids += tok.encode(text[pos : match.start()], add_special_tokens=False)
        ids += tok.encode_plain(str(messages[int(match[1])]["content"]))
        pos = match.end()
    ids += tok.encode(text[pos:], add_special_tokens=False)
    return ids
