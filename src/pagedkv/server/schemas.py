"""Request bodies of the OpenAI-compatible API (pydantic models) and their validation.

Fields the server does not implement are accepted and ignored when absent or null, and rejected
with a 400 when set, so a client never silently gets less than it asked for. vLLM's extra
sampling fields (``min_tokens``, ``guided_json``, ...) come through the body, as the ``openai``
client's ``extra_body`` sends them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=-1, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # request features (OpenAI, then vLLM's extras)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported_fields(self) -> list[str]:
        """Extra fields set to something other than null/false/empty (not implemented)."""
        extra = self.model_extra or {}
        return sorted(k for k, v in extra.items() if v not in (None, False, [], {}, 0))


class CompletionRequest(_SamplingFields):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v: str | list[int]) -> str | list[int]:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call it answers

    def template_dict(self) -> dict[str, Any]:
        """The message as a chat template sees it (tool fields only when set)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        for key in ("name", "tool_calls", "tool_call_id"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part of type {part.get('type')!r} is not supported")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
