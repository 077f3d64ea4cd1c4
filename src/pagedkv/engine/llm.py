"""Offline generation: ``LLM(model_dir).generate(prompts, sampling)`` with a progress bar."""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from pagedkv.engine.chat_encoding import encode_chat
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import GenerationOutput
from pagedkv.engine.sampler import SamplingParams
from pagedkv.errors import InvalidRequestError
from pagedkv.kvevents.config import KVEventsConfig
from pagedkv.tiers.config import TierConfig

Prompt = str | Sequence[int] | Mapping[str, Any]
"""Text, token ids, or vLLM's prompt dicts: ``{"prompt": text}`` or ``{"prompt_token_ids":
ids}``, each with an optional ``"cache_salt"`` (see :meth:`LLMEngine.add_request`)."""
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
Conversation = Sequence[Mapping[str, Any]]  # chat messages: {"role": ..., "content": str}


class LLM:
    """Load a local model (a Hugging Face folder or a GGUF file) once; generate for batches.

    Keyword arguments are :class:`EngineConfig` fields (``block_size=16``,
    ``enable_prefix_caching=False``, ``num_speculative_tokens=4``, ...), plus the KV tiers:
    ``host_tier_bytes``, ``disk_tier`` (a folder) with ``disk_tier_bytes``, ``redis_url``
    (or a whole ``tiers=TierConfig(...)``). ``dtype="auto"`` (the default) follows the
    checkpoint on CUDA and computes in float32 on a CPU; ``chat_template`` (a file or an inline
    template) replaces the checkpoint's; ``generation_config="vllm"`` ignores its
    ``generation_config.json``. With tiers, call :meth:`close` (or use ``with``)
    so queued blocks reach them before the process exits. ``kv_events="tcp://HOST:PORT"`` (or a
    :class:`KVEventsConfig`) publishes KV events over ZeroMQ.
    """

    def __init__(
        self,
        model_dir: str,
        config: EngineConfig | None = None,
        *,
        host_tier_bytes: int = 0,
        disk_tier: str | os.PathLike[str] | None = None,
        disk_tier_bytes: int = 0,
        redis_url: str | None = None,
        **kwargs: Any,
    ) -> None:
        cfg = config or EngineConfig()
        if isinstance(kwargs.get("kv_events"), str):
            kwargs["kv_events"] = KVEventsConfig(kwargs["kv_events"])
        if kwargs:
            try:
                cfg = replace(cfg, **kwargs)
            except TypeError as exc:
                raise InvalidRequestError(f"unknown engine option: {exc}") from None
        if host_tier_bytes or disk_tier is not None or disk_tier_bytes or redis_url:
            if cfg.tiers is not None:
                raise InvalidRequestError("give the KV tiers either as tiers= or as tier options")
            tiers = TierConfig(
                host_bytes=host_tier_bytes,
                disk_dir=None if disk_tier is None else os.fspath(disk_tier),
                disk_bytes=disk_tier_bytes,
                redis_url=redis_url,
            )
            cfg = replace(cfg, tiers=tiers)
        self.engine = LLMEngine.from_model_dir(model_dir, cfg)
        self._ids = itertools.count()
        # Without an explicit close(), the tiers are still flushed and closed when this object
        # is collected or the interpreter exits (the finalizer holds the tiers, not the engine).
        tio = self.engine.tier_io
        self._finalizer = None if tio is None else weakref.finalize(self, tio.close)
        pub = self.engine.kv_publisher
        self._kv_finalizer = None if pub is None else weakref.finalize(self, pub.close)

    def close(self) -> None:
        """Write queued KV blocks to the tiers and close them (a no-op without tiers; safe to
        call twice)."""
        if self._finalizer is not None:
            self._finalizer()  # runs tio.close() once, then detaches
        if self._kv_finalizer is not None:
            self._kv_finalizer()

    def reset_prefix_cache(self, reset_running: bool = False) -> None:
        """Forget the device prefix cache (``LLMEngine.reset_prefix_cache``)."""
        self.engine.reset_prefix_cache(reset_running)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """The sampling used when ``generate`` gets none: the checkpoint's
        ``generation_config.json`` values (temperature, top_p, top_k, max_new_tokens) over
        ``SamplingParams``' defaults, as vLLM's ``LLM.get_default_sampling_params``."""
        return self.engine.default_sampling_params()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = True,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[GenerationOutput]:
        """Generate for every prompt (text, token ids or a prompt dict); results in the
        prompts' order. ``sampling_params`` and ``use_tqdm`` are vLLM's names for
        ``sampling`` and ``progress``."""
        sampling = _either("sampling", sampling, "sampling_params", sampling_params)
        progress = progress if use_tqdm is None else use_tqdm
        items: list[Prompt]
        if isinstance(prompts, str | Mapping) or (
            isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)
        ):
            items = [prompts]  # type: ignore[list-item]  # one prompt (text, ids or a dict)
        else:
            items = list(prompts)  # type: ignore[arg-type]
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or self.get_default_sampling_params()] * len(items)
        else:
            params = list(sampling)
            if len(params) != len(items):
                raise InvalidRequestError(
                    f"{len(params)} sampling params for {len(items)} prompts; give one or one each"
                )
        ids = [f"gen-{next(self._ids)}" for _ in items]
        self._add_all(ids, items, params)
        results: dict[str, GenerationOutput] = {}
        if progress:
            from rich.console import Console
            from rich.progress import Progress

            with Progress(console=Console(stderr=True), transient=True) as bar:
                task = bar.add_task("generating", total=len(items))
                self._drain(results, lambda: bar.update(task, completed=len(results)))
        else:
            self._drain(results, lambda: None)
        return [results[rid] for rid in ids]

    def _add_all(self, ids: list[str], items: list[Prompt], params: list[SamplingParams]) -> None:
        """Queue every prompt, or none: a refused prompt aborts those queued before it."""
        added: list[str] = []
        try:
            for rid, item, p in zip(ids, items, params, strict=True):
                prompt, salt = _unpack_prompt(item)
                self.engine.add_request(rid, prompt, p, cache_salt=salt)
                added.append(rid)
        except BaseException:
            for rid in added:
                self.engine.abort(rid)
            raise

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        progress: bool = True,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | None = None,
    ) -> list[GenerationOutput]:
        """Generate for one conversation or a list of them, as vLLM's ``LLM.chat``: each is
        rendered by the model's chat template and tokenized as the server does
        (:func:`~pagedkv.engine.chat_encoding.encode_chat`: a special token's text typed in a
        content stays plain text), then generated as :meth:`generate` does. A message's
        ``content`` must be a string (or None); content parts are refused by name, as is a
        model without a tokenizer or a chat template. ``continue_final_message`` and
        ``chat_template_kwargs`` as vLLM's (:func:`~pagedkv.engine.chat_encoding.encode_chat`)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise InvalidRequestError("chat needs a tokenizer; this model has none")
        convs = [messages] if messages and isinstance(messages[0], Mapping) else messages
        prompts: list[Prompt] = []
        for conv in convs:
            for m in conv:
                if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                    raise InvalidRequestError(f"a chat message is a mapping with a 'role': {m!r}")
                if m.get("content") is not None and not isinstance(m["content"], str):
                    raise InvalidRequestError(
                        "LLM.chat takes a message 'content' as a string; content parts "
                        f"({type(m['content']).__name__}) are not supported"
                    )
            ids = encode_chat(
                tok,
                conv,  # type: ignore[arg-type]
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                continue_final_message=continue_final_message,
                chat_template_kwargs=chat_template_kwargs,
            )
            prompts.append(ids)
        return self.generate(
            prompts, sampling, progress=progress, sampling_params=sampling_params, use_tqdm=use_tqdm
        )

    def _drain(self, results: dict[str, GenerationOutput], on_step: Any) -> None:
        engine = self.engine
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
            on_step()


def _either(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    """``value`` or ``alias_value`` (vLLM's keyword for the same argument), not both."""
    if value is not None and alias_value is not None:
        raise InvalidRequestError(f"give {name} or {alias}, not both")
    return alias_value if value is None else value


def _unpack_prompt(item: Prompt) -> tuple[str | Sequence[int], str | None]:
    """A prompt's text or ids and its cache salt; a dict with other keys (vLLM's
    ``multi_modal_data``, ...) or with neither ``prompt`` nor ``prompt_token_ids`` is refused."""
    if not isinstance(item, Mapping):
        return item, None
    unknown = sorted(set(item) - _PROMPT_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"unsupported prompt field(s): {', '.join(map(str, unknown))} "
            f"(a prompt dict takes {', '.join(sorted(_PROMPT_KEYS))})"
        )
    salt = item.get("cache_salt")
    if "prompt_token_ids" in item:  # vLLM's TokensPrompt: the ids win over a "prompt" text
        ids = item["prompt_token_ids"]
        if isinstance(ids, str) or not isinstance(ids, Sequence):
            raise InvalidRequestError("prompt_token_ids must be a list of token ids")
        return ids, salt
    if isinstance(item.get("prompt"), str):
        return item["prompt"], salt
    raise InvalidRequestError("a prompt dict needs a 'prompt' string or 'prompt_token_ids'")
