"""Greedy outputs with prefix blocks reloaded from each KV tier equal transformers' outputs.

Each case runs the shared-prefix prompts through an engine whose only tier is host RAM, a
disk folder or a real ``redis-server``: the first pass computes every block (and writes it
through to the tier), then the device pool forgets every prefix and the second pass loads
them back from the tier. Both passes must give transformers' greedy tokens, the second with
blocks really loaded (the tier counts hits, the scheduler counts loaded blocks). Cases cover a
chunked prefill and a block size (5) that divides none of the prompts.

The last tests pin "a tier slower than recompute is skipped": with the engine's measured
recompute cost, a tier whose loads take longer per block is skipped (counted) and the prompt is
recomputed with the same tokens, while a fast host tier is used.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from differential.test_engine_invariance import GREEDY, PROMPTS, checkpoint
from e2e.conftest import RedisServer
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.loader import load_model
from pagedkv.engine.tier_io import read_blocks
from pagedkv.errors import InvalidRequestError
from pagedkv.tiers import HostTier, OffloadCoordinator, TierConfig, TierLayout

pytest.importorskip("transformers")

__all__ = ["checkpoint"]  # the module-scoped fixture, shared

CASES = {
    "plain": {"block_size": 4},
    "chunked": {"block_size": 4, "max_num_batched_tokens": 7, "max_num_seqs": 4},
    "block5": {"block_size": 5},
}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def _tiers(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> TierConfig:
    if kind == "host":
        return TierConfig(host_bytes=64 << 20)
    if kind == "disk":
        return TierConfig(disk_dir=str(tmp_path / "kv"), disk_bytes=64 << 20)
    url = request.getfixturevalue("redis_url")
    return TierConfig(redis_url=url)


def _engine(path: Path, tiers: TierConfig, model_id: str, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(num_blocks=512, check_invariants=True, model_id=model_id, tiers=tiers, **kw)
    return LLMEngine(load_model(path), None, cfg)


_PASSES = itertools.count()


def _first_tokens(engine: LLMEngine, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Greedy tokens of each prompt, added one per step (ids unique to this pass)."""
    tag = next(_PASSES)
    pending = list(enumerate(prompts))
    done: dict[int, list[int]] = {}
    while pending or engine.has_unfinished_requests():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(f"p{tag}-{i}", p, GREEDY)
        for out in engine.step():
            if out.finished:
                done[int(out.request_id.rsplit("-", 1)[1])] = list(out.outputs[0].token_ids)
        engine.check_invariants()
    return [done[i] for i in range(len(prompts))]


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kind", ["host", "disk", pytest.param("redis", marks=pytest.mark.redis)])
def test_blocks_reloaded_from_a_tier_give_transformers_tokens(
    checkpoint: tuple[Path, list[list[int]]],
    tmp_path: Path,
    request: pytest.FixtureRequest,
    kind: str,
    case: str,
) -> None:
    path, refs = checkpoint
    # a model id per case: the Redis server is shared by the module, its keys must not be
    engine = _engine(path, _tiers(kind, tmp_path, request), f"tiny-{kind}-{case}", **CASES[case])
    tio = engine.tier_io
    assert tio is not None
    tio.measure_recompute = False  # pin "always load": the skip has its own tests below
    try:
        assert _first_tokens(engine, PROMPTS) == refs  # computed, written through
        assert tio.offload.flush(10.0)
        stored = tio.tier_stats()[0]
        assert stored.name == kind
        assert stored.bytes_in > 0
        engine.scheduler.manager.reset_prefix_cache()  # the device forgets every prefix
        assert _first_tokens(engine, PROMPTS) == refs  # reloaded from the tier
        after = tio.tier_stats()[0]
        assert after.hits > stored.hits
        assert after.bytes_out > stored.bytes_out
        assert engine.scheduler.num_loaded_blocks > 0
        assert tio.num_loaded == engine.scheduler.num_loaded_blocks
        assert tio.num_failed_loads == 0
        tio.offload.check_invariants()
    finally:
        engine.close()


class SlowHostTier(HostTier):
    """A host tier whose reads take ``delay_s`` per block (a tier slower than recompute)."""

    def __init__(self, layout: TierLayout, delay_s: float) -> None:
        super().__init__(layout, 64 << 20, name="slow")
        self.delay_s = delay_s

    def get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        time.sleep(self.delay_s * len(block_hashes))
        return super().get_many(block_hashes)


def _engine_over(path: Path, tier: HostTier) -> tuple[LLMEngine, OffloadCoordinator]:
    offload = OffloadCoordinator([tier], reprobe_every=1000)
    cfg = EngineConfig(block_size=4, num_blocks=512, check_invariants=True, model_id="tiny")
    return LLMEngine(load_model(path), None, cfg, offload=offload), offload


def _layout(path: Path) -> TierLayout:
    m = load_model(path).config
    return TierLayout("tiny", m.num_hidden_layers, m.num_key_value_heads, m.head_dim, 4, "float32")


def test_a_tier_slower_than_recompute_is_skipped(
    checkpoint: tuple[Path, list[list[int]]],
) -> None:
    path, refs = checkpoint
    slow = SlowHostTier(_layout(path), delay_s=0.05)  # raised below to 10x recompute if needed
    engine, offload = _engine_over(path, slow)
    tio = engine.tier_io
    assert tio is not None
    try:
        assert _first_tokens(engine, PROMPTS) == refs
        assert tio.prefill_s_per_token is not None  # measured from the prefill steps
        recompute_s = tio.prefill_s_per_token * 4
        # slower than recompute by 10x whatever this machine's load makes recompute cost
        slow.delay_s = max(slow.delay_s, 10 * recompute_s)
        assert offload.flush(10.0)
        # one load measures the tier (nothing is known about it before)
        engine.scheduler.manager.reset_prefix_cache()
        assert _first_tokens(engine, PROMPTS[:1]) == refs[:1]
        loaded = engine.scheduler.num_loaded_blocks
        assert loaded > 0
        measured = dict(offload.stats().load_s_per_block)["slow"]
        assert measured > recompute_s
        # from now on the tier is skipped: every prompt is recomputed, with the same tokens
        engine.scheduler.manager.reset_prefix_cache()
        assert _first_tokens(engine, PROMPTS) == refs
        assert engine.scheduler.num_loaded_blocks == loaded
        assert offload.stats().skipped_slow > 0
    finally:
        engine.close()


def test_a_tier_faster_than_recompute_is_used(
    checkpoint: tuple[Path, list[list[int]]],
) -> None:
    path, refs = checkpoint
    engine, offload = _engine_over(path, HostTier(_layout(path), 64 << 20))
    tio = engine.tier_io
    assert tio is not None
    try:
        for _ in range(3):  # measured each round; the host tier keeps being used
            loaded = engine.scheduler.num_loaded_blocks
            assert _first_tokens(engine, PROMPTS) == refs
            assert offload.flush(10.0)
            engine.scheduler.manager.reset_prefix_cache()
        assert tio.prefill_s_per_token is not None
        assert engine.scheduler.num_loaded_blocks > loaded > 0
        assert offload.stats().skipped_slow == 0
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_batched_block_reads_equal_one_by_one_reads(dtype: torch.dtype) -> None:
    spec = KVCacheSpec(3, 4, 2, 8, dtype)
    kv = PagedKVCache(spec, 10)
    gen = torch.Generator().manual_seed(0)
    for buf in (*kv.k, *kv.v):
        buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    ids = [7, 0, 3, 3, 9]
    assert read_blocks(kv, ids) == [kv.read_block(b) for b in ids]
    assert read_blocks(kv, [5]) == [kv.read_block(5)]
    assert read_blocks(kv, []) == []
    with pytest.raises(InvalidRequestError):
        read_blocks(kv, [1, 10])


def test_a_quantized_engine_never_loads_a_float32_engines_blocks(
    checkpoint: tuple[Path, list[list[int]]], tmp_path: Path
) -> None:
    """Two engines of one checkpoint over one disk folder: the int8 one computes with other
    weights, so it is in another namespace and loads none of the float32 engine's blocks,
    while a second float32 engine (a restart) loads them."""
    path, refs = checkpoint
    tiers = TierConfig(disk_dir=str(tmp_path / "kv"), disk_bytes=64 << 20)

    def run(**kw: Any) -> tuple[list[list[int]], int, str]:
        engine = _engine(path, tiers, "tiny", block_size=4, **kw)
        tio = engine.tier_io
        assert tio is not None
        tio.measure_recompute = False
        try:
            tokens = _first_tokens(engine, PROMPTS)
            assert tio.offload.flush(10.0)
            return tokens, engine.scheduler.num_loaded_blocks, engine.config.model_id
        finally:
            engine.close()

    tokens, loaded, namespace = run()
    assert (tokens, loaded, namespace) == (refs, 0, "tiny")
    _, loaded_q, namespace_q = run(quantization="int8")
    assert loaded_q == 0  # the float32 blocks are on disk, under another namespace
    assert namespace_q == "tiny+quant=int8"
    again, loaded_again, _ = run()
    assert again == refs
    assert loaded_again > 0  # the float32 restart finds them
