"""A request body's sampling fields -> :class:`SamplingParams` (OpenAI's names, then vLLM's
extras), and the one structured-output constraint among ``response_format``, ``guided_*`` and a
tool choice."""

from __future__ import annotations

import json

from pagedkv.engine.generation_config import GenerationDefaults
from pagedkv.engine.sampler import SamplingParams, StructuredOutputsParams
from pagedkv.errors import InvalidRequestError
from pagedkv.server.schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields
from pagedkv.server.tool_calls import ToolPlan


def sampling_params(
    body: _SamplingFields,
    max_tokens: int,
    tools: ToolPlan | None = None,
    defaults: GenerationDefaults | None = None,
) -> SamplingParams:
    """The request's sampling; a field it leaves unset (``None``) takes the checkpoint's
    ``generation_config.json`` default (``defaults``), then SamplingParams' own. Raises
    InvalidRequestError for values or combinations the engine cannot honour."""
    return (defaults or GenerationDefaults()).sampling_params(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=None if body.top_k is None else max(0, body.top_k),
        seed=body.seed,
        n=body.n,
        stop=tuple(body.stop_strings()),
        stop_token_ids=tuple(body.stop_token_ids or ()),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        min_p=body.min_p,
        logit_bias=_logit_bias(body.logit_bias),
        min_tokens=body.min_tokens,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=num_logprobs(body),
        structured_outputs=structured_outputs(body, tools),
    )


def num_logprobs(body: _SamplingFields) -> int | None:
    """Top logprobs per token, or None when logprobs were not asked for."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if isinstance(body, ChatCompletionRequest):
        if body.top_logprobs is not None and not body.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        return (body.top_logprobs or 0) if body.logprobs else None
    return None


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidRequestError(f"logit_bias keys must be token ids, got {key!r}") from None
    return tuple(out.items())


def structured_outputs(
    body: _SamplingFields, tools: ToolPlan | None
) -> StructuredOutputsParams | None:
    """The constraint the body asks for; more than one is refused (nothing says which wins)."""
    found: list[tuple[str, StructuredOutputsParams]] = []
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", StructuredOutputsParams(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise InvalidRequestError("response_format json_schema needs a json_schema field")
        found.append(
            ("response_format", StructuredOutputsParams.from_schema(fmt.json_schema.json_schema))
        )
    if body.guided_json is not None:
        schema = body.guided_json
        if isinstance(schema, str):
            try:
                json.loads(schema)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(f"guided_json is not valid JSON: {exc}") from None
        found.append(("guided_json", StructuredOutputsParams.from_schema(schema)))
    if body.guided_regex is not None:
        found.append(("guided_regex", StructuredOutputsParams(regex=body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", StructuredOutputsParams(choice=tuple(body.guided_choice))))
    if tools is not None and tools.structured is not None:
        found.append((f"tool_choice={tools.mode}", tools.structured))
    if len(found) > 1:
        names = ", ".join(n for n, _ in found)
        raise InvalidRequestError(f"only one structured output constraint per request, got {names}")
    return found[0][1] if found else None
