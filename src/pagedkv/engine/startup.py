"""The one start-up line a command that loads a model prints on stderr.

Example (the tiny model)::

    pagedkv: model /m (llama, xxh3-128:3f2a9c01...) | dtype float32 | context 4096 tokens |
    KV pool 1024 blocks x 16 = 16384 tokens, 0.0078 GiB | decode attention native |
    chat template tokenizer_config.json | tiers: none

(one line; wrapped here).
"""

from __future__ import annotations

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.tiers.config import TierConfig
from pagedkv.tiers.urls import redact_url

_GIB = float(1 << 30)


def describe_tiers(tiers: TierConfig | None) -> str:
    if tiers is None or not tiers.is_enabled:
        return "none"
    parts = []
    if tiers.host_bytes:
        parts.append(f"host {tiers.host_bytes / _GIB:.2f} GiB")
    if tiers.disk_dir is not None:
        parts.append(f"disk {tiers.disk_dir} {tiers.disk_bytes / _GIB:.2f} GiB")
    if tiers.redis_url is not None:
        parts.append(f"redis {redact_url(tiers.redis_url)}")  # no password in the log
    return ", ".join(parts)


def startup_line(engine: LLMEngine, model: str) -> str:
    """Model, architecture, checkpoint fingerprint, dtype, context length, KV pool (blocks,
    tokens, GiB), decode attention kernel, chat template source, tiers."""
    cfg, mcfg = engine.config, engine.model.config
    spec = engine.runner.kv_cache.spec
    num_blocks = engine.scheduler.manager.pool.num_blocks
    tokens = engine.scheduler.manager.pool.capacity_blocks * spec.block_size  # less the null
    pool_gib = num_blocks * spec.bytes_per_block / _GIB
    tok = engine.tokenizer
    template = "none" if tok is None or tok.chat_template is None else tok.chat_template.source
    kernel = "native" if engine.runner.uses_native_decode() else "torch"
    fingerprint = cfg.model_id[:21] + ("..." if len(cfg.model_id) > 21 else "")
    quant = f", {cfg.quantization} weights" if cfg.quantization else ""
    if cfg.gguf_activations != "float32":
        quant += f", {cfg.gguf_activations} activations"
    if cfg.matmul_precision != "highest":  # what runs (the model's), not only what was asked
        quant += f", matmul precision {engine.model.matmul_precision}"
    return (
        f"pagedkv: model {model} ({mcfg.model_type}, {fingerprint}) | dtype {cfg.dtype}{quant} | "
        f"context {engine.max_model_len} tokens | KV pool {num_blocks} blocks x "
        f"{spec.block_size} = {tokens} tokens, {pool_gib:.3g} GiB | decode attention {kernel} | "
        f"chat template {template} | tiers: {describe_tiers(cfg.tiers)}"
    )
