"""Per-node back-off on a real 3-master Redis Cluster: a lost master costs only its own slots.

With ``cluster-require-full-coverage no`` (the ``redis_cluster_partial`` fixture) the surviving
masters keep serving; the tier backs off only the dead master, re-probes it after the back-off
and serves its slots again once it is back. Under Redis's default (``yes``, ``redis_cluster``)
the survivors refuse every slot (``CLUSTERDOWN``) about one node timeout after the loss, and
the tier backs them off too: every key misses, nothing raises.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot

from pagedkv.engine.llm import LLM
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.errors import TierUnavailableError
from pagedkv.tiers import PayloadHeader, TierLayout, encode
from pagedkv.tiers.redis_tier import RedisTier

pytestmark = pytest.mark.redis

RedisCluster = Any  # tests/e2e/conftest.py's RedisCluster (conftest modules are not imported)

LAYOUT = TierLayout("m", num_layers=2, num_kv_heads=2, head_dim=16, block_size=8)
N = 60


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def pl(i: int) -> bytes:
    return encode(PayloadHeader(LAYOUT, h(i), 8), bytes([i % 256]) * LAYOUT.block_bytes)


def keys_on(cluster: RedisCluster, tier: RedisTier, index: int) -> set[int]:
    """The blocks whose keys master ``index`` holds, asked of that master directly (a key of
    another master's slot answers MOVED)."""
    held = set()
    with redis.Redis(port=cluster.nodes[index].port) as node:
        for i in range(N):
            try:
                if node.exists(tier.key_of(h(i))):
                    held.add(i)
            except redis.exceptions.MovedError:
                pass
    return held


def test_a_lost_master_misses_only_its_own_slots_and_returns_after_back_off(
    redis_cluster_partial: RedisCluster,
) -> None:
    cluster = redis_cluster_partial
    tier = RedisTier(
        cluster.url, LAYOUT, connect_timeout_s=0.2, socket_timeout_s=0.5,
        backoff_initial_s=0.2, backoff_max_s=0.4,
    )  # fmt: skip
    try:
        assert tier.put_many((h(i), pl(i)) for i in range(N)) == N
        lost = keys_on(cluster, tier, 1)
        assert 0 < len(lost) < N
        alive = set(range(N)) - lost

        cluster.nodes[1].stop()
        t0 = time.monotonic()
        rounds = 0
        while time.monotonic() - t0 < 3.0:  # past the 1 s node timeout: the cluster knows
            got = tier.get_many([h(i) for i in range(N)])
            hits = {i for i, g in enumerate(got) if g is not None}
            assert hits == alive  # every survivor's key hits, every lost key misses
            assert all(got[i] == pl(i) for i in hits)
            assert tier.down_nodes() in ([], [cluster.name(1)])  # [] between re-probes
            assert tier.put_many((h(i), pl(i)) for i in sorted(lost)) == 0  # dropped
            rounds += 1
            time.sleep(0.05)
        stats = tier.stats()
        assert stats.hits >= rounds * len(alive)
        # one failed round trip per re-probe (every 0.2-0.4 s), not one per operation
        assert 1 <= stats.errors <= 3.0 / 0.2 + 2 < rounds
        assert stats.dropped_writes == rounds * len(lost)
        assert tier.contains_prefix([h(i) for i in sorted(alive)]) == len(alive)
        with pytest.raises(TierUnavailableError, match=cluster.name(1)) as info:
            tier.health_check()
        dead = str(info.value).split(" from ", 1)[1]  # only the stopped master is named
        assert cluster.name(0) not in dead
        assert cluster.name(2) not in dead
        tier.check_invariants()

        cluster.nodes[1].start()  # same port and nodes.conf, no keys (no persistence)
        cluster.wait_state_ok()
        deadline = time.monotonic() + 10.0
        while tier.put_many((h(i), pl(i)) for i in sorted(lost)) < len(lost):
            assert time.monotonic() < deadline, "the restarted master was never re-probed"
            time.sleep(0.1)
        assert tier.get_many([h(i) for i in range(N)]) == [pl(i) for i in range(N)]
        assert keys_on(cluster, tier, 1) == lost
        assert tier.down_nodes() == []
        tier.health_check()  # every master answers again
        tier.check_invariants()
    finally:
        tier.close()


def test_full_coverage_default_makes_survivors_refuse_every_slot(
    redis_cluster: RedisCluster,
) -> None:
    tier = RedisTier(redis_cluster.url, LAYOUT, connect_timeout_s=0.2, socket_timeout_s=0.5)
    try:
        assert tier.put_many((h(i), pl(i)) for i in range(N)) == N
        redis_cluster.nodes[1].stop()
        deadline = time.monotonic() + 10.0
        while any(g is not None for g in tier.get_many([h(i) for i in range(N)])):
            assert time.monotonic() < deadline, "the survivors never answered CLUSTERDOWN"
            time.sleep(0.1)
        assert tier.put_many((h(i), pl(i)) for i in range(N, N + 10)) == 0  # nothing raises
        assert tier.stats().errors > 0
        tier.check_invariants()
    finally:
        tier.close()


def test_engine_tokens_unchanged_while_survivors_serve_their_blocks(
    redis_cluster_partial: RedisCluster, tmp_path: Path
) -> None:
    cluster = redis_cluster_partial
    model = write_tiny_model(tmp_path / "model")
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = [[(s * 37 + i * 11) % 250 + 3 for i in range(100)] for s in range(6)]
    plain = LLM(str(model), block_size=16, num_blocks=128)
    expected = [list(o.outputs[0].token_ids) for o in plain.generate(prompts, sp, progress=False)]
    with LLM(str(model), block_size=16, num_blocks=128, redis_url=cluster.url) as writer:
        writer.generate(prompts, sp, progress=False)
        tio = writer.engine.tier_io
        assert tio is not None
        assert tio.offload.flush(10.0)
    assert cluster.dbsize(2) > 0

    cluster.nodes[2].stop()
    with LLM(str(model), block_size=16, num_blocks=128, redis_url=cluster.url) as reader:
        outs = reader.generate(prompts, sp, progress=False)
        rtio = reader.engine.tier_io
        assert rtio is not None
        (stats,) = rtio.tier_stats()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected  # misses recompute
    assert stats.errors > 0  # the lost master was noticed
    assert stats.hits > 0  # and the survivors' blocks were still loaded


def test_a_moved_slot_refreshes_the_slot_map(redis_cluster_partial: RedisCluster) -> None:
    cluster = redis_cluster_partial
    tier = RedisTier(cluster.url, LAYOUT, connect_timeout_s=0.2, socket_timeout_s=0.5)
    clients = [redis.Redis(port=n.port) for n in cluster.nodes]
    try:
        key = tier.key_of(h(500))
        slot = key_slot(key)

        def owns(c: Any) -> bool:
            try:
                c.exists(key)
            except redis.exceptions.MovedError:
                return False
            return True

        (owner,) = [i for i, c in enumerate(clients) if owns(c)]
        target = (owner + 1) % 3
        target_id = clients[target].execute_command("CLUSTER MYID")
        for i in (target, owner, (owner + 2) % 3):  # the slot is empty: no keys to migrate
            clients[i].execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
        assert owns(clients[target])
        assert not owns(clients[owner])

        assert not tier.put(h(500), pl(500))  # the stale map sent it to the old owner: MOVED
        assert tier.stats().errors == 1
        assert tier.down_nodes() == []  # a live node that answers MOVED is not backed off
        assert tier.put(h(500), pl(500))  # the map was refreshed first
        assert clients[target].exists(key) == 1
        assert tier.try_get(h(500)) == pl(500)
        tier.check_invariants()
    finally:
        tier.close()
        for c in clients:
            c.close()


def test_a_failover_is_followed_and_the_promoted_replica_serves(
    redis_cluster_replicated: RedisCluster,
) -> None:
    cluster = redis_cluster_replicated
    clients = [redis.Redis(port=n.port) for n in cluster.nodes]
    tier = RedisTier(
        cluster.url, LAYOUT, connect_timeout_s=0.2, socket_timeout_s=0.5,
        backoff_initial_s=0.2, backoff_max_s=0.4,
    )  # fmt: skip
    try:
        assert tier.put_many((h(i), pl(i)) for i in range(N)) == N
        masters = [i for i, c in enumerate(clients) if c.execute_command("ROLE")[0] == b"master"]
        assert len(masters) == 3
        for i in masters:  # every replica has acknowledged the writes
            assert clients[i].execute_command("WAIT", 1, 5000) == 1
        lost = masters[0] if masters[0] != 0 else masters[1]  # keep the URL's node up
        held = keys_on(cluster, tier, lost)
        assert held

        cluster.nodes[lost].stop()
        deadline = time.monotonic() + 20.0
        while True:
            got = tier.get_many([h(i) for i in range(N)])
            assert all(g is None or g == pl(i) for i, g in enumerate(got))  # never wrong data
            if all(g is not None for g in got):
                break  # the replica took over and the tier's slot map found it
            assert time.monotonic() < deadline, "the tier never followed the failover"
            time.sleep(0.1)
        assert tier.stats().errors > 0  # the lost master was noticed on the way
        assert tier.put(h(N + 1), pl(N + 1))  # writes go to the new masters too
        assert tier.try_get(h(N + 1)) == pl(N + 1)
        tier.check_invariants()
    finally:
        tier.close()
        for c in clients:
            c.close()
