"""Wiring an ``LLMEngine``: the checkpoint it loads and each component's section of the config.

One :class:`EngineConfig` is built at the edge; here it is resolved once against the model
(``dtype``, ``max_model_len``, the cache namespace) and cut into the sections each component
receives: the KV tensors' :class:`KVCacheSpec`, the pool's :class:`CacheConfig`, the
scheduler's :class:`SchedulerConfig` and the tiers' :class:`TierLayout`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedkv.core.config import CacheConfig
from pagedkv.engine.chat_template import load_chat_template
from pagedkv.engine.dtype import resolve_dtype
from pagedkv.engine.engine_config import PREFIX_HASH_ALGOS, EngineConfig
from pagedkv.engine.fingerprint import checkpoint_fingerprint
from pagedkv.engine.generation_config import load_generation_defaults
from pagedkv.engine.gguf_loader import is_gguf_file, load_gguf_checkpoint
from pagedkv.engine.kv_cache import KVCacheSpec, parse_dtype
from pagedkv.engine.loader import load_model
from pagedkv.engine.model_config import ModelConfig
from pagedkv.engine.models.llama import LlamaModel
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import InvalidRequestError
from pagedkv.sched import SchedulerConfig
from pagedkv.tiers.offload import OffloadCoordinator
from pagedkv.tiers.payload import TierLayout

if TYPE_CHECKING:
    from pagedkv.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EngineSections:
    """The sections of one resolved ``EngineConfig`` that the engine's components receive."""

    spec: KVCacheSpec  # the KV tensors' shape and dtype
    cache: CacheConfig  # the block pool and manager
    scheduler: SchedulerConfig
    layout: TierLayout  # what a tier payload names (model id, shape, dtype)
    num_blocks: int  # equal to cache.num_blocks: the pool's size in blocks


def check_max_model_len(config: EngineConfig, mcfg: ModelConfig) -> int:
    """The context length: ``max_model_len``, else the model's; never past the model's."""
    max_len = config.max_model_len or mcfg.max_position_embeddings
    if max_len > mcfg.max_position_embeddings:
        raise InvalidRequestError(
            f"max_model_len {max_len} exceeds the model's max_position_embeddings "
            f"({mcfg.max_position_embeddings})"
        )
    return max_len


def build_sections(config: EngineConfig, mcfg: ModelConfig, max_len: int) -> EngineSections:
    """Cut a resolved config (``dtype`` not ``auto``) into each component's section; the
    pool holds ``num_blocks``, else as many blocks as ``kv_cache_bytes`` buys, else 1024."""
    spec = KVCacheSpec(
        mcfg.num_hidden_layers,
        config.block_size,
        mcfg.num_key_value_heads,
        mcfg.head_dim,
        parse_dtype(config.dtype),
    )
    num_blocks = config.num_blocks
    if num_blocks is None:
        budget = config.kv_cache_bytes
        num_blocks = spec.num_blocks_for(budget) if budget is not None else 1024
    cache_cfg = CacheConfig(
        block_size=config.block_size,
        num_blocks=num_blocks,
        initial_blocks=config.initial_blocks,
        enable_prefix_caching=config.enable_prefix_caching,
        hash_algo=PREFIX_HASH_ALGOS[config.prefix_caching_hash_algo],
        model_id=config.model_id,
        watermark=config.watermark,
        reservation=config.reservation,  # type: ignore[arg-type]  # validated by CacheConfig
        # every layer windowed: blocks before the window are released (core/config.py)
        sliding_window=mcfg.sliding_window if mcfg.all_layers_windowed else None,
        enable_events=config.kv_events is not None,
    )
    sched_cfg = SchedulerConfig(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_len,
        enable_chunked_prefill=config.enable_chunked_prefill,
        check_invariants=config.check_invariants,
    )
    layout = TierLayout(
        config.model_id or "model",
        mcfg.num_hidden_layers,
        mcfg.num_key_value_heads,
        mcfg.head_dim,
        config.block_size,
        str(spec.dtype).removeprefix("torch."),
    )
    return EngineSections(spec, cache_cfg, sched_cfg, layout, num_blocks)


def cache_namespace(model_id: str, model: LlamaModel, gguf_activations: str = "float32") -> str:
    """The prefix-hash root and the tiers' namespace: ``model_id`` (the checkpoint's
    fingerprint unless the user named one), plus what else decides the KV a block holds:

    - a weight quantization (``int8``, ``gguf``) computes with other weights than the
      checkpoint's, so its KV is another model's;
    - 8-bit activations on the GGUF layers (``gguf_activations="int8"``) round each layer's
      input, so its KV differs from the float32 path's by more than float32 rounding;
    - a compute dtype other than the weights' (bf16 weights widened and computed in float32,
      against torch's bf16 ops where the kernel does not build) writes other values into a
      cache of the same dtype.
    - bf16 arithmetic in the linear layers (``matmul_precision="medium"`` where it runs:
      inputs rounded to bf16) writes KV that differs by more than float32 rounding.

    Engines differing in any of these never share a hash chain or a tier key, so a block one of them
    stored is never served to the other. Kernel choices that change only float32 summation
    order (``linear_kernel``, the decode kernel) keep the namespace: their KV agree to within
    float32 rounding. An unnamed engine (``""``, built from a model) stays unnamed unless there
    is a suffix to add."""
    suffix = []
    if model.quantization is not None:
        suffix.append(f"quant={model.quantization}")
    if gguf_activations != "float32":
        suffix.append(f"act={gguf_activations}")
    if model.compute_dtype is not model.dtype:
        suffix.append(f"compute={str(model.compute_dtype).removeprefix('torch.')}")
    if model.matmul_precision != "highest":
        suffix.append(f"matmul={model.matmul_precision}")
    if not suffix:
        return model_id
    return "+".join([model_id or "model", *suffix])


def eos_token_ids(mcfg: ModelConfig, tokenizer: Tokenizer | None) -> tuple[int, ...]:
    """The model's end-of-sequence ids and the tokenizer's, sorted."""
    eos = set(mcfg.eos_token_ids)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        eos.add(tokenizer.eos_token_id)
    return tuple(sorted(eos))


def engine_from_model_dir(
    cls: type[LLMEngine],
    model_dir: str,
    config: EngineConfig | None,
    offload: OffloadCoordinator | None,
) -> LLMEngine:
    """``LLMEngine.from_model_dir``: a checkpoint folder or a GGUF file."""
    cfg = config or EngineConfig()
    device = resolve_device(cfg.device)
    mcfg = ModelConfig.from_file(model_dir) if Path(model_dir).is_dir() else None
    cfg = replace(
        cfg, dtype=resolve_dtype(cfg.dtype, mcfg.torch_dtype if mcfg else "float32", device)
    )
    if is_gguf_file(model_dir):
        return _from_gguf(cls, model_dir, cfg, offload=offload)
    model = load_model(model_dir, dtype=cfg.dtype, device=device)
    tok_dir = cfg.tokenizer or model_dir
    tok = None
    if cfg.tokenizer is not None or (Path(tok_dir) / "tokenizer.json").is_file():
        tok = Tokenizer(tok_dir)
    return _from_checkpoint(cls, model_dir, model, tok, cfg, offload)


def _from_checkpoint(
    cls: type[LLMEngine],
    path: str,
    model: LlamaModel,
    tok: Tokenizer | None,
    cfg: EngineConfig,
    offload: OffloadCoordinator | None,
) -> LLMEngine:
    """The engine of a loaded checkpoint (any format): its namespace (the fingerprint),
    the ``chat_template`` override, its generation defaults and their extra eos ids."""
    defaults = load_generation_defaults(path, cfg.generation_config)
    if tok is not None and cfg.chat_template is not None:
        tok.chat_template = load_chat_template(cfg.chat_template)
    cfg = replace(cfg, model_id=cfg.model_id or checkpoint_fingerprint(path))
    engine = cls(model, tok, cfg, offload=offload)
    engine.generation_defaults = defaults
    engine.eos_token_ids = tuple(sorted({*engine.eos_token_ids, *defaults.eos_token_ids}))
    for name, value in defaults.unsupported().items():
        logger.warning(
            "%s sets %s=%s, which pagedkv's sampler does not implement; it is not applied",
            defaults.source,
            name,
            value,
        )
    return engine


def _from_gguf(
    cls: type[LLMEngine], path: str, cfg: EngineConfig, *, offload: OffloadCoordinator | None
) -> LLMEngine:
    """A GGUF file: model, tokenizer and (unless given) a model id from its content."""
    ckpt = load_gguf_checkpoint(path, dtype=cfg.dtype, device=resolve_device(cfg.device))
    if not cfg.model_id:
        cfg = replace(cfg, model_id=ckpt.fingerprint)
    tok = Tokenizer(cfg.tokenizer) if cfg.tokenizer is not None else ckpt.tokenizer
    return _from_checkpoint(cls, path, ckpt.model, tok, cfg, offload)


def resolve_device(name: str) -> torch.device:
    """``name`` as a device; refuses CUDA where it is not available."""
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError(f"device {name!r} was asked for but CUDA is not available")
    return torch.device(name)
