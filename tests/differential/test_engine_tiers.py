"""KV reloaded from a tier gives the same tokens as KV computed on the device."""

from __future__ import annotations

from pathlib import Path

import pytest

from differential.test_engine_invariance import PROMPTS, checkpoint, run_engine
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.loader import load_model
from pagedkv.tiers import HostTier, OffloadCoordinator, TierLayout

pytest.importorskip("transformers")

__all__ = ["checkpoint"]  # the module-scoped fixture, shared


def _engine_with_host_tier(path: Path) -> tuple[LLMEngine, HostTier, OffloadCoordinator]:
    model = load_model(path)
    m = model.config
    layout = TierLayout(
        "tiny", m.num_hidden_layers, m.num_key_value_heads, m.head_dim, 4, "float32"
    )
    host = HostTier(layout, 64 << 20)
    offload = OffloadCoordinator([host])
    cfg = EngineConfig(block_size=4, num_blocks=256, check_invariants=True, model_id="tiny")
    engine = LLMEngine(model, None, cfg, offload=offload)
    assert engine.tier_io is not None
    assert engine.tier_io.layout == layout
    return engine, host, offload


def test_prefix_reloaded_from_the_host_tier_gives_identical_tokens(
    checkpoint: tuple[Path, list[list[int]]],
) -> None:
    path, refs = checkpoint
    engine, host, offload = _engine_with_host_tier(path)
    try:
        assert [g[0] for g in run_engine(engine, PROMPTS)] == refs
        assert offload.flush(10.0)
        assert host.num_blocks > 0
        engine.scheduler.manager.reset_prefix_cache()  # the device forgets every prefix
        assert [g[0] for g in run_engine(engine, PROMPTS)] == refs
        assert engine.scheduler.num_loaded_blocks > 0
        assert engine.tier_io is not None
        assert engine.tier_io.num_failed_loads == 0
    finally:
        offload.close()


def test_corrupt_tier_payloads_are_recomputed_never_used(
    checkpoint: tuple[Path, list[list[int]]],
) -> None:
    path, refs = checkpoint
    engine, host, offload = _engine_with_host_tier(path)
    try:
        run_engine(engine, PROMPTS)
        assert offload.flush(10.0)
        # flip one byte in the middle of every stored payload (the body, past the header)
        with host._lock:
            for h, data in list(host._lru.items()):
                bad = bytearray(data)
                bad[len(bad) // 2] ^= 0xFF
                host._lru[h] = bytes(bad)
        engine.scheduler.manager.reset_prefix_cache()
        assert [g[0] for g in run_engine(engine, PROMPTS)] == refs
        assert engine.tier_io is not None
        assert engine.tier_io.num_failed_loads > 0  # the tier said "held", the checks said no
        assert engine.tier_io.num_loaded == 0
    finally:
        offload.close()


@pytest.mark.parametrize("num_speculative_tokens", [0, 4])
def test_blocks_filled_by_accepted_drafts_reach_the_tier(
    checkpoint: tuple[Path, list[list[int]]], num_speculative_tokens: int
) -> None:
    """Every full block a request computed is stored, whether a decode or an accepted draft
    filled it (before the fix, 13 of 20 blocks were stored with 4 drafts per step)."""
    from differential.test_engine_invariance import OracleProposer

    path, refs = checkpoint
    engine, host, offload = _engine_with_host_tier(path)
    if num_speculative_tokens:
        engine = LLMEngine(
            load_model(path),
            None,
            EngineConfig(
                block_size=4,
                num_blocks=256,
                check_invariants=True,
                model_id="tiny",
                num_speculative_tokens=num_speculative_tokens,
            ),
            offload=offload,
        )
        engine.proposer = OracleProposer(PROMPTS, refs)
    try:
        assert [g[0] for g in run_engine(engine, PROMPTS, stagger=False)] == refs
        assert offload.flush(10.0)
        if num_speculative_tokens:
            assert engine.num_accepted_draft_tokens > 0
        # every full block of prompt + output (minus the last token, never computed) is stored
        mgr = engine.scheduler.manager
        full: set[bytes] = set()
        for i, (p, r) in enumerate(zip(PROMPTS, refs, strict=True)):
            mgr.add_request(f"probe{i}", (p + r)[:-1])  # hashed as the engine hashes
            full.update(mgr.block_hashes(f"probe{i}"))
            mgr.free(f"probe{i}")
        assert len(full) > 20
        assert sum(host.contains(h) for h in full) == len(full)
    finally:
        offload.close()
