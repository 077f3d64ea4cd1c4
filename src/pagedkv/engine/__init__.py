"""The reference engine: paged KV tensors, attention, Llama-family models, sampler and LLM API.

This is the only package of pagedkv that imports torch. Its exports load on first use (PEP 562),
so importing a torch-free submodule (``pagedkv.engine.tokenizer``, ``pagedkv.engine.chat_template``:
what the router tokenizes with) does not import torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pagedkv.engine.engine_config import EngineConfig
    from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache
    from pagedkv.engine.llm import LLM
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.model_config import ModelConfig, RopeConfig
    from pagedkv.engine.outputs import CompletionOutput, GenerationOutput
    from pagedkv.engine.sampler import SamplingParams
    from pagedkv.engine.tokenizer import IncrementalDetokenizer, Tokenizer

_EXPORTS = {
    "LLM": "llm",
    "CompletionOutput": "outputs",
    "EngineConfig": "engine_config",
    "GenerationOutput": "outputs",
    "IncrementalDetokenizer": "tokenizer",
    "KVCacheSpec": "kv_cache",
    "LLMEngine": "llm_engine",
    "ModelConfig": "model_config",
    "PagedKVCache": "kv_cache",
    "RopeConfig": "model_config",
    "SamplingParams": "sampler",
    "Tokenizer": "tokenizer",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "GenerationOutput",
    "IncrementalDetokenizer",
    "KVCacheSpec",
    "LLMEngine",
    "ModelConfig",
    "PagedKVCache",
    "RopeConfig",
    "SamplingParams",
    "Tokenizer",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # later lookups skip this function
    return value
