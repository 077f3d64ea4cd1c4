"""Request bodies of the OpenAI-compatible API (pydantic models) and their validation.

Fields the server does not implement are accepted and ignored when absent, null or set to the
value that asks for the default (``response_format={"type": "text"}``, ``best_of=1``,
``service_tier="auto"``, ``parallel_tool_calls``, ``modalities=["text"]``), and rejected with
a 400 naming the parameter otherwise, so a client never silently gets less than it asked for.
``metadata`` (OpenAI's tags for stored completions) is validated to OpenAI's limits and unused.
vLLM's extra sampling fields (``min_tokens``, ``guided_json``, ...) come through the body, as
the ``openai`` client's ``extra_body`` sends them.
"""

from __future__ import annotations

from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pagedkv.errors import UnsupportedParameterError

MAX_SEED = 2**63 - 1  # int64, as vLLM
MAX_N = 128  # SamplingParams' limit; samples past max_num_seqs queue as their own requests
MAX_PROMPTS = 128  # prompts in one /v1/completions batch, each its own engine request

_DEFAULT_VALUES: dict[str, tuple[Any, ...]] = {
    # values of fields the server does not implement that ask for what it does anyway
    "response_format": ({"type": "text"},),
    "best_of": (1,),
    "service_tier": ("auto", "default"),
    "parallel_tool_calls": (True,),
    "echo": (False,),
    "logprobs": (False,),
    "store": (False,),
    "modalities": (["text"],),
}

MAX_METADATA_KEYS = 16  # OpenAI's limits on ``metadata``: 16 pairs, keys 64 and values 512 chars
MAX_METADATA_KEY = 64
MAX_METADATA_VALUE = 512


def _is_default(name: str, value: Any) -> bool:
    if value in (None, False, [], {}, 0):  # 0 and 0.0 too: penalties at their default
        return True
    return any(value == d and type(value) is type(d) for d in _DEFAULT_VALUES.get(name, ()))


class StreamOptions(BaseModel):
    """``include_usage`` (OpenAI): a last event with the usage; vLLM's
    ``continuous_usage_stats`` (with it): the usage so far on every event. OpenAI's
    ``include_obfuscation`` is accepted: this server never pads events. Others are refused."""

    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool | None = None


class JsonSchemaFormat(BaseModel):
    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}``. An unknown key is refused, never ignored."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    # None: unset, so the checkpoint's generation_config.json default applies (as vLLM)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's key-value tags for stored completions: validated, then unused (nothing is stored,
    # and they never reach the model), so a client that tags every request is not refused
    metadata: dict[str, str] | None = None
    # request features (OpenAI, then vLLM's extras)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=2.0)  # None: checkpoint's
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    cache_salt: str | None = Field(default=None, min_length=1)  # vLLM's: a tenant's hash seed

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} metadata pairs")
        for key, value in v.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(
                    f"metadata keys are at most {MAX_METADATA_KEY} characters and values "
                    f"at most {MAX_METADATA_VALUE}"
                )
        return v

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def unsupported_fields(self) -> list[str]:
        """Extra fields set to something other than null/false/empty or their default value
        (not implemented)."""
        extra = self.model_extra or {}
        return sorted(k for k, v in extra.items() if not _is_default(k, v))

    def check_supported(self) -> None:
        """Raise UnsupportedParameterError naming the first unsupported field that is set."""
        unsupported = self.unsupported_fields()
        if unsupported:
            raise UnsupportedParameterError(
                f"unsupported parameter(s): {', '.join(unsupported)} (this server does not "
                "implement them; leave them unset or at their default)",
                unsupported[0],
            )


class CompletionRequest(_SamplingFields):
    """``prompt`` is a string or token ids, or a batch of them (``[str, ...]`` or
    ``[[ids], ...]``); a batch of one (what LangChain and the ``openai`` client send for one
    prompt) is that prompt. A batch answers one choice per prompt and sample
    (:mod:`pagedkv.server.prompt_batch`)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=None, ge=0)  # 0: with echo, the prompt only
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompts(
        cls, v: str | list[int] | list[str] | list[list[int]]
    ) -> str | list[int] | list[str] | list[list[int]]:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        if isinstance(v, list) and isinstance(v[0], str | list):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"a batch of {len(v)} prompts; at most {MAX_PROMPTS} per request")
            if any(isinstance(p, list) and not p for p in v):
                raise ValueError("prompt must not contain an empty list of token ids")
        return v

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or more."""
        v = self.prompt
        if isinstance(v, list) and isinstance(v[0], str | list):
            return cast("list[str | list[int]]", list(v))
        return [v]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it: ``role``, ``content`` (text) and each of
        ``name``, ``tool_calls``, ``tool_call_id`` that is set. A non-null field the server
        does not know raises ValueError (never dropped silently)."""
        unknown = sorted(k for k, v in (self.model_extra or {}).items() if v is not None)
        if unknown:
            raise ValueError(f"unsupported message field(s): {', '.join(unknown)}")
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
    # vLLM's chat extras (encode_chat): continue the final message; extra template variables
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
