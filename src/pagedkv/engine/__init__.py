"""The reference engine: paged KV tensors, attention, Llama-family models, sampler and LLM API.

This is the only package of pagedkv that imports torch.
"""

from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache
from pagedkv.engine.llm import LLM
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.model_config import ModelConfig, RopeConfig
from pagedkv.engine.outputs import CompletionOutput, GenerationOutput
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tokenizer import IncrementalDetokenizer, Tokenizer

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
