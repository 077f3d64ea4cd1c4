"""Request bodies to prompt token ids, off the event loop and bounded before any work.

Tokenizing and rendering a chat template cost CPU time proportional to the text (a 10 MB prompt
took 34 s), so the handlers run them in a worker thread (``asyncio.to_thread``); the tokenizer
releases the GIL while it encodes, so the event loop keeps answering (``/health`` included).
Before any of that, a text longer than ``max_model_len`` tokens could ever hold (the longest
token's characters times ``max_model_len``) is refused at once with PromptTooLongError.

Chat content is tokenized so that only the template writes control tokens
(``pagedkv.engine.chat_encoding``); a ``/v1/completions`` text prompt is the caller's raw prompt,
so special tokens written in it are parsed, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pagedkv.engine.chat_encoding import encode_chat
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import InvalidRequestError, PromptTooLongError
from pagedkv.server.schemas import ChatCompletionRequest


def require_tokenizer(tok: Tokenizer | None, what: str) -> Tokenizer:
    if tok is None:
        raise InvalidRequestError(f"this model has no tokenizer; {what}")
    return tok


def check_text_length(tok: Tokenizer, num_chars: int, max_model_len: int) -> None:
    """Refuse text that cannot fit in ``max_model_len`` tokens, without tokenizing it."""
    bound = max_model_len * tok.max_token_chars
    if num_chars > bound:
        raise PromptTooLongError(
            f"prompt has {num_chars} characters; max_model_len is {max_model_len} tokens "
            f"(at most {bound} characters at {tok.max_token_chars} per token)"
        )


def text_prompt_ids(
    tok: Tokenizer | None, prompt: str, max_model_len: int, *, add_special_tokens: bool = True
) -> list[int]:
    """The ids of a text prompt (special tokens in it parsed). Blocking: run in a thread."""
    t = require_tokenizer(tok, "send token ids")
    check_text_length(t, len(prompt), max_model_len)
    return t.encode(prompt, add_special_tokens=add_special_tokens)


def chat_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The messages as the template sees them (``role``, ``content`` and, when set, ``name``,
    ``tool_calls``, ``tool_call_id``). Raises InvalidRequestError for unsupported parts."""
    try:
        return [m.template_dict() for m in body.messages]
    except ValueError as exc:
        raise InvalidRequestError(str(exc)) from None


def chat_prompt_ids(
    tok: Tokenizer | None,
    messages: list[dict[str, Any]],
    max_model_len: int,
    tools: Sequence[Mapping[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: Mapping[str, Any] | None = None,
) -> list[int]:
    """The ids of a chat (and its ``tools``, for the template) under the model's template
    (``encode_chat``'s options). Blocking: run in a thread."""
    t = require_tokenizer(tok, "chat needs one")
    num_chars = sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))
    check_text_length(t, num_chars, max_model_len)
    return encode_chat(
        t,
        messages,
        add_generation_prompt=add_generation_prompt,
        tools=tools,
        continue_final_message=continue_final_message,
        chat_template_kwargs=chat_template_kwargs,
    )
