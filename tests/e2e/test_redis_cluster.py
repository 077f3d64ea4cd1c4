"""The Redis tier on a real 3-master Redis Cluster: keys spread over slots, a lost master misses.

The cluster is started by the ``redis_cluster`` fixture (``tests/e2e/conftest.py``) on
loopback; the tier reaches it through a ``redis+cluster://`` URL (``redis.cluster.RedisCluster``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from pagedkv.core.events import BlockRemoved
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.tiers import PayloadHeader, TierLayout, encode
from pagedkv.tiers.redis_tier import RedisTier

pytestmark = pytest.mark.redis

RedisCluster = Any  # tests/e2e/conftest.py's RedisCluster (conftest modules are not imported)

LAYOUT = TierLayout("m", num_layers=2, num_kv_heads=2, head_dim=16, block_size=8)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def pl(i: int) -> bytes:
    return encode(PayloadHeader(LAYOUT, h(i), 8), bytes([i % 256]) * LAYOUT.block_bytes)


def test_cluster_tier_spreads_keys_and_misses_for_a_stopped_master(
    redis_cluster: RedisCluster,
) -> None:
    tier = RedisTier(redis_cluster.url, LAYOUT, connect_timeout_s=0.2, socket_timeout_s=0.5)
    tier.enable_events()
    try:
        assert tier.put_many((h(i), pl(i)) for i in range(60)) == 60
        events = tier.drain_events()
        assert [e.block_hashes for e in events] == [(h(i),) for i in range(60)]
        assert {(type(e).__name__, e.medium) for e in events} == {("BlockStored", "redis")}
        assert tier.delete(h(59))
        assert tier.drain_events() == [BlockRemoved((h(59),), medium="redis")]
        assert tier.put(h(59), pl(59))
        tier.drain_events()
        sizes = [redis_cluster.dbsize(i) for i in range(3)]
        assert sum(sizes) == 60
        assert min(sizes) > 0  # every master took some of the slots' keys
        assert tier.get_many([h(i) for i in range(60)]) == [pl(i) for i in range(60)]
        assert tier.contains_prefix([h(i) for i in range(60)]) == 60

        redis_cluster.nodes[1].stop()  # a master goes away mid-run (no replica takes over)
        t0 = time.monotonic()
        got = [tier.try_get(h(i)) for i in range(60)]
        assert time.monotonic() - t0 < 30  # bounded: misses, not a hang
        assert all(g is None or g == pl(i) for i, g in enumerate(got))  # never wrong data
        assert sum(g is None for g in got) >= sizes[1]  # at least the lost master's keys miss
        tier.put_many((h(i), pl(i)) for i in range(60, 70))  # dropped or stored, never raises
        stats = tier.stats()
        assert stats.errors > 0
        assert stats.misses >= sizes[1]
        tier.check_invariants()
    finally:
        tier.close()


def test_engine_keeps_serving_through_a_lost_cluster_master(
    redis_cluster: RedisCluster, tmp_path: Path
) -> None:
    model = write_tiny_model(tmp_path / "model")
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[(s * 37 + i * 11) % 250 + 3 for i in range(100)] for s in range(3)]
    plain = LLM(str(model), block_size=16, num_blocks=128)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, sp, progress=False)]
    with LLM(str(model), block_size=16, num_blocks=128, redis_url=redis_cluster.url) as writer:
        writer.generate(prompts, sp, progress=False)
        tio = writer.engine.tier_io
        assert tio is not None
        assert tio.offload.flush(10.0)
    assert sum(redis_cluster.dbsize(i) for i in range(3)) == 3 * 6  # 6 full blocks a prompt

    redis_cluster.nodes[2].stop()
    with LLM(str(model), block_size=16, num_blocks=128, redis_url=redis_cluster.url) as reader:
        outs = reader.generate(prompts, sp, progress=False)
        rtio = reader.engine.tier_io
        assert rtio is not None
        (redis_stats,) = rtio.tier_stats()
    assert redis_stats.errors > 0  # the lost master was noticed (its slots, or the whole
    assert redis_stats.lookup_misses > 0  # cluster once it is marked failed) and missed
    assert [list(o.outputs[0].token_ids) for o in outs] == expected  # misses recompute
