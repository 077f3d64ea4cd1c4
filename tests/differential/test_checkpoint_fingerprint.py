"""The cache namespace names the weights, not the folder: a model folder overwritten with other
weights is served none of the old weights' KV from the disk tier or Redis, while the same
weights (in the same folder again, or copied elsewhere) are.

Real files, a real ``redis-server``, engines built by ``from_model_dir`` (where the namespace
is derived), tokens compared with an engine that has no tier at all.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from differential.test_engine_invariance import GREEDY, PROMPTS
from e2e.conftest import RedisServer
from pagedkv.engine import fingerprint
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.fingerprint import checkpoint_fingerprint
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.tiers import TierConfig


@pytest.fixture
def redis_url(tmp_path: Path) -> Iterator[str]:
    server = RedisServer(tmp_path / "redis-data")
    (tmp_path / "redis-data").mkdir()
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def _run(model: Path, tiers: TierConfig | None) -> tuple[list[list[int]], int, int]:
    """Greedy tokens of every prompt; the tier's hits and the blocks loaded from it."""
    engine = LLMEngine.from_model_dir(
        str(model), EngineConfig(block_size=4, num_blocks=512, tiers=tiers, check_invariants=True)
    )
    tio = engine.tier_io
    if tio is not None:
        tio.measure_recompute = False  # always load what the tier has: the test is about keys
    try:
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, GREEDY)
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        if tio is not None:
            assert tio.offload.flush(10.0)
        hits = 0 if tio is None else sum(t.hits for t in tio.tier_stats())
        return (
            [done[f"r{i}"] for i in range(len(PROMPTS))],
            hits,
            engine.scheduler.num_loaded_blocks,
        )
    finally:
        engine.close()


def _overwritten_folder_serves_no_old_kv(tmp_path: Path, tiers: TierConfig) -> None:
    model = write_tiny_model(tmp_path / "model", seed=0)
    old_id = checkpoint_fingerprint(model)
    old_tokens, _, _ = _run(model, tiers)  # computed, written to the tier
    _, hits, loaded = _run(model, tiers)
    assert hits > 0
    assert loaded > 0

    write_tiny_model(tmp_path / "model", seed=1)  # other weights, same shapes, same path
    assert checkpoint_fingerprint(model) != old_id
    fresh, _, _ = _run(model, None)
    new_tokens, hits, loaded = _run(model, tiers)
    assert (hits, loaded) == (0, 0)  # none of the old KV
    assert new_tokens == fresh
    assert new_tokens != old_tokens  # the weights really changed what the model computes

    copy = shutil.copytree(model, tmp_path / "elsewhere")  # same weights, another path
    assert checkpoint_fingerprint(copy) == checkpoint_fingerprint(model)
    copied_tokens, hits, loaded = _run(copy, tiers)
    assert hits > 0
    assert loaded > 0
    assert copied_tokens == fresh


def test_overwritten_folder_disk_tier(tmp_path: Path) -> None:
    tiers = TierConfig(disk_dir=str(tmp_path / "kv"), disk_bytes=64 << 20)
    _overwritten_folder_serves_no_old_kv(tmp_path, tiers)


@pytest.mark.redis
def test_overwritten_folder_redis_tier(tmp_path: Path, redis_url: str) -> None:
    _overwritten_folder_serves_no_old_kv(tmp_path, TierConfig(redis_url=redis_url))


def test_fingerprint_names_content_not_path_or_mtime(tmp_path: Path) -> None:
    a = write_tiny_model(tmp_path / "a", seed=3)
    b = write_tiny_model(tmp_path / "b", seed=3)
    fa = checkpoint_fingerprint(a)
    assert fa == checkpoint_fingerprint(b)
    assert fa.startswith("xxh3-128:")
    assert str(tmp_path) not in fa
    one = shutil.copy(a / "model.safetensors", tmp_path / "one.gguf")  # a single-file checkpoint
    other = shutil.copy(a / "model.safetensors", tmp_path / "renamed.gguf")
    assert checkpoint_fingerprint(one) == checkpoint_fingerprint(other) != fa
    tok = a / "tokenizer_config.json"
    tok.write_text(tok.read_text().replace("</s>", "<|end|>"))  # the tokenizer is part of it
    assert checkpoint_fingerprint(a) != fa


def test_large_file_hash_is_cached_and_a_rewrite_is_noticed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(fingerprint, "CACHE_MIN_BYTES", 1)  # cache every file
    model = write_tiny_model(tmp_path / "m", seed=0)
    first = checkpoint_fingerprint(model)
    entries = sorted((tmp_path / "cache" / "fingerprints").glob("*.json"))
    assert len(entries) == len(fingerprint.checkpoint_files(model))
    calls: list[Path] = []
    real = fingerprint._hash_bytes

    def counting(file: Path) -> str:
        calls.append(file)
        return real(file)

    monkeypatch.setattr(fingerprint, "_hash_bytes", counting)
    assert checkpoint_fingerprint(model) == first
    assert calls == []  # every content hash came from the cache
    write_tiny_model(tmp_path / "m", seed=1)  # rewritten in place: same sizes
    assert checkpoint_fingerprint(model) != first
    assert model / "model.safetensors" in calls
