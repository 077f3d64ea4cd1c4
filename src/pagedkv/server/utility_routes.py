"""The server's endpoints besides generation: vLLM's ``/tokenize``, ``/detokenize`` and
``/version``, and OpenAI's ``/v1/models/{id}``, in those servers' request and response shapes.

``/tokenize`` takes a completion-style ``{"prompt": ...}`` or a chat-style ``{"messages": ...}``
body and answers ``{"count", "max_model_len", "tokens", "token_strs"}``; the chat form gives
exactly the ids ``/v1/chat/completions`` would run (same template, same special-token rule).
``/detokenize`` takes ``{"tokens": [...]}`` and answers ``{"prompt": text}``. Both check
``model`` when it is given (an unknown one is a 404 ``model_not_found``).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from pagedkv import __version__
from pagedkv.errors import InvalidRequestError, PagedKVError, UnsupportedParameterError
from pagedkv.server.async_engine import AsyncEngine
from pagedkv.server.prompts import (
    chat_messages,
    chat_prompt_ids,
    require_tokenizer,
    text_prompt_ids,
)
from pagedkv.server.schemas import ChatCompletionRequest, ChatMessage


class ModelNotFoundError(PagedKVError, LookupError):
    """The request names a model this server does not serve (404 ``model_not_found``)."""


class TokenizeRequest(BaseModel):
    """vLLM's ``TokenizeCompletionRequest`` or ``TokenizeChatRequest`` (one of ``prompt`` and
    ``messages``)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)


def check_model(requested: str | None, served: str) -> None:
    """Raise ModelNotFoundError unless ``requested`` is None or the served model's id."""
    if requested is not None and requested != served:
        raise ModelNotFoundError(
            f"the model {requested!r} does not exist; this server serves {served!r}"
        )


def model_card(engine: AsyncEngine, created: int) -> dict[str, Any]:
    """The served model in ``/v1/models``: OpenAI's fields and vLLM's ``max_model_len``."""
    return {
        "id": engine.model_name,
        "object": "model",
        "created": created,
        "owned_by": "pagedkv",
        "max_model_len": engine.engine.max_model_len,
    }


def add_utility_routes(app: FastAPI, engine: AsyncEngine, created: int) -> None:
    """Register ``/tokenize``, ``/detokenize``, ``/version`` and ``/v1/models/{model_id}``."""
    served = engine.model_name
    max_len = engine.engine.max_model_len

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models/{model_id:path}")
    async def one_model(model_id: str) -> dict[str, Any]:
        check_model(model_id, served)
        return model_card(engine, created)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        check_model(body.model, served)
        tok = engine.engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("send exactly one of 'prompt' and 'messages'")
        if body.messages is not None:
            if body.add_special_tokens:  # the template writes the specials of a chat
                raise UnsupportedParameterError(
                    "add_special_tokens=true is not supported with messages (the chat "
                    "template writes the special tokens)",
                    "add_special_tokens",
                )
            chat = ChatCompletionRequest(model=served, messages=body.messages)
            messages = chat_messages(chat)
            ids = await asyncio.to_thread(
                chat_prompt_ids,
                tok,
                messages,
                max_len,
                add_generation_prompt=body.add_generation_prompt,
            )
        else:
            assert body.prompt is not None  # checked above
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await asyncio.to_thread(
                text_prompt_ids, tok, body.prompt, max_len, add_special_tokens=special
            )
        strs = require_tokenizer(tok, "").token_strings(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": max_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        check_model(body.model, served)
        tok = require_tokenizer(engine.engine.tokenizer, "nothing to detokenize with")
        vocab = engine.engine.model.config.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token ids outside [0, {vocab}): {bad[:5]}")
        text = await asyncio.to_thread(tok.decode, body.tokens)
        return {"prompt": text}
