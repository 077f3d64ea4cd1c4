"""The token ids of a request's prompt, computed as the engine computes them.

Completions: a text prompt is ``encode(prompt)`` (special tokens added), a token-id prompt is
taken as is. Chat: the chat template with ``add_generation_prompt=True``, then
``encode(text, add_special_tokens=False)``. Both mirror :mod:`pagedkv.server.app`. Anything
this cannot read (a batch of prompts, a content part that is not text) gives ``None``: the
request is routed by load alone and the engine gives the verdict on the request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class PromptTokenizer:
    """The engines' tokenizer (``tokenizer.json`` and chat template of the model folder)."""

    def __init__(self, model_dir: str | Path) -> None:
        from pagedkv.engine.tokenizer import Tokenizer  # the engine's own code (torch-free)

        self._tok = Tokenizer(model_dir)

    @staticmethod
    def token_prompt(path: str, body: dict[str, Any]) -> list[int] | None:
        """A completions prompt given as token ids (no tokenizer needed), else None."""
        prompt = body.get("prompt")
        if path != "/v1/completions" or not isinstance(prompt, list) or not prompt:
            return None
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        return None

    def prompt_ids(self, path: str, body: dict[str, Any]) -> list[int] | None:
        try:
            if path == "/v1/chat/completions":
                return self._chat_ids(body.get("messages"))
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return self._tok.encode(prompt)
        except (ValueError, TypeError, KeyError):  # the engine will answer this request's 400
            return None
        return self.token_prompt(path, body)

    def _chat_ids(self, messages: Any) -> list[int] | None:
        if not isinstance(messages, list):
            return None
        turns = []
        for m in messages:
            content = m.get("content") if isinstance(m, dict) else None
            if content is None:
                content = ""
            elif isinstance(content, list):
                if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                    return None
                content = "".join(str(p.get("text", "")) for p in content)
            elif not isinstance(content, str):
                return None
            turns.append({"role": m.get("role"), "content": content})
        text = self._tok.apply_chat_template(turns, add_generation_prompt=True)
        return self._tok.encode(text, add_special_tokens=False)
