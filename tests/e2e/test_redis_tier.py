"""Redis tier against a real redis-server: round trip, NX, TTL, pipelining, server failures."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from pagedkv.errors import InvalidRequestError, TierUnavailableError
from pagedkv.tiers import HostTier, OffloadCoordinator, PayloadHeader, TierLayout, encode
from pagedkv.tiers.redis_tier import RedisTier

pytestmark = pytest.mark.redis

RedisServer = Any  # tests/e2e/conftest.py's RedisServer (conftest modules are not imported)

LAYOUT = TierLayout("m", num_layers=2, num_kv_heads=2, head_dim=16, block_size=8)


def h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def pl(i: int, fill: int | None = None) -> bytes:
    byte = i % 256 if fill is None else fill
    return encode(PayloadHeader(LAYOUT, h(i), 8), bytes([byte]) * LAYOUT.block_bytes)


@pytest.fixture
def tier(redis_server: RedisServer) -> Iterator[RedisTier]:
    t = RedisTier(redis_server.url, LAYOUT)
    yield t
    t.close()


@pytest.fixture
def raw(redis_server: RedisServer) -> Iterator[Any]:
    client = redis.Redis.from_url(redis_server.url)
    yield client
    client.close()


def test_round_trip_one_key_per_block(tier: RedisTier, raw: Any) -> None:
    assert tier.put(h(1), pl(1))
    assert tier.try_get(h(1)) == pl(1)
    assert tier.try_get(h(2)) is None
    assert raw.keys("*") == [f"{LAYOUT.namespace}:{h(1).hex()}".encode()]
    s = tier.stats()
    assert (s.hits, s.misses, s.bytes_in, s.bytes_out) == (1, 1, len(pl(1)), len(pl(1)))
    assert tier.delete(h(1))
    assert tier.contains_prefix([h(1)]) == 0
    tier.check_invariants()


def test_set_if_absent_keeps_the_first_copy(tier: RedisTier) -> None:
    assert tier.put(h(1), pl(1, fill=7))
    assert tier.put(h(1), pl(1, fill=9))  # present: fine, not overwritten
    assert tier.try_get(h(1)) == pl(1, fill=7)
    assert tier.stats().bytes_in == len(pl(1))  # the second copy was never sent


def test_ttl_expires_blocks(redis_server: RedisServer, raw: Any) -> None:
    tier = RedisTier(redis_server.url, LAYOUT, ttl_s=1)
    tier.put(h(1), pl(1))
    assert 0 < raw.pttl(tier.key_of(h(1))) <= 1000
    time.sleep(1.2)
    assert tier.try_get(h(1)) is None
    tier.close()


def test_namespaces_do_not_mix(redis_server: RedisServer, tier: RedisTier) -> None:
    other = TierLayout("m", 2, 2, 16, 8, "bfloat16")
    theirs = RedisTier(redis_server.url, other)
    tier.put(h(1), pl(1))
    assert theirs.contains_prefix([h(1)]) == 0
    assert theirs.try_get(h(1)) is None
    theirs.close()


class PipelineCounter:
    """Counts pipeline round trips by wrapping ``Pipeline.execute``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = redis.client.Pipeline.execute

        def execute(pipe: Any, *args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return original(pipe, *args, **kwargs)

        monkeypatch.setattr(redis.client.Pipeline, "execute", execute)


def test_batches_are_pipelined_and_bounded(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    size = len(pl(0))
    tier = RedisTier(redis_server.url, LAYOUT, batch_max_keys=8, batch_max_bytes=100 * size)
    counter = PipelineCounter(monkeypatch)
    assert tier.put_many((h(i), pl(i)) for i in range(100)) == 100
    assert counter.calls == 2 * 13  # EXISTS then SET NX per batch of <= 8 keys
    counter.calls = 0
    assert tier.contains_prefix([h(i) for i in range(100)]) == 100
    assert counter.calls == 13
    counter.calls = 0
    assert tier.get_many([h(i) for i in range(100)]) == [pl(i) for i in range(100)]
    assert counter.calls == 13
    counter.calls = 0
    assert tier.contains_prefix([h(0), h(1), h(500), *[h(i) for i in range(2, 60)]]) == 2
    assert counter.calls == 1  # stops at the batch holding the first miss
    tier.close()

    by_bytes = RedisTier(redis_server.url, LAYOUT, batch_max_keys=64, batch_max_bytes=3 * size)
    counter.calls = 0
    assert by_bytes.get_many([h(i) for i in range(9)]) == [pl(i) for i in range(9)]
    assert counter.calls == 3  # three payloads per response
    by_bytes.close()


def test_server_stopped_mid_run_misses_and_drops_without_raising(
    redis_server: RedisServer,
) -> None:
    now = [0.0]
    tier = RedisTier(redis_server.url, LAYOUT, clock=lambda: now[0], backoff_initial_s=1.0)
    tier.put_many((h(i), pl(i)) for i in range(4))
    redis_server.stop()
    assert tier.contains_prefix([h(0), h(1)]) == 0
    assert tier.is_down()
    assert tier.try_get(h(0)) is None
    assert not tier.put(h(9), pl(9))
    assert tier.put_many((h(i), pl(i)) for i in range(10, 13)) == 0
    s = tier.stats()
    assert s.errors == 1  # one failed round trip; the rest skipped during the back-off
    assert s.dropped_writes == 4
    assert s.misses == 1
    assert s.lookup_misses == 1
    with pytest.raises(TierUnavailableError):
        tier.health_check()
    tier.check_invariants()

    redis_server.start()  # same port, empty (no persistence): blocks were lost
    now[0] += 10.0
    assert tier.try_get(h(0)) is None
    assert tier.put(h(9), pl(9))
    assert tier.try_get(h(9)) == pl(9)
    assert not tier.is_down()
    tier.health_check()
    tier.check_invariants()
    tier.close()


def test_back_off_doubles_and_is_capped(redis_server: RedisServer) -> None:
    now = [0.0]
    tier = RedisTier(
        redis_server.url,
        LAYOUT,
        clock=lambda: now[0],
        backoff_initial_s=1.0,
        backoff_max_s=4.0,
    )
    redis_server.stop()
    waits = []
    for _ in range(5):
        tier.try_get(h(0))
        assert tier.is_down()
        start = now[0]
        while tier.is_down():
            now[0] += 0.5
        waits.append(now[0] - start)
    assert waits == [1.0, 2.0, 4.0, 4.0, 4.0]
    assert tier.stats().errors == 5
    tier.check_invariants()
    tier.close()


def test_corrupt_value_is_a_miss_deleted_and_counted(tier: RedisTier, raw: Any) -> None:
    tier.put(h(1), pl(1))
    raw.set(tier.key_of(h(1)), pl(1)[:-3])
    raw.set(tier.key_of(h(2)), pl(3))  # a whole payload of another block under this key
    assert tier.get_many([h(1), h(2)]) == [None, None]
    assert raw.exists(tier.key_of(h(1)), tier.key_of(h(2))) == 0
    assert tier.stats().corrupt == 2


def test_keys_evicted_by_the_server_are_misses(small_redis_server: RedisServer) -> None:
    tier = RedisTier(small_redis_server.url, LAYOUT)
    n = 4 * (4 << 20) // len(pl(0))  # four times what fits
    stored = tier.put_many((h(i), pl(i)) for i in range(n))
    assert stored == n  # writes succeed; the server evicts old keys to make room
    # Read the newest key first: the large pipelined reads below fill reply buffers, which the
    # server counts as memory, so it may evict again while they run (the keys they read are
    # then more recently used than the newest write).
    assert tier.try_get(h(n - 1)) == pl(n - 1)
    assert tier.contains_prefix([h(i) for i in range(n)]) < n // 2
    got = tier.get_many([h(i) for i in range(n)])
    assert sum(g is None for g in got) > n // 2
    assert tier.stats().errors == 0
    tier.close()


def test_two_engines_share_prefix_blocks_through_redis(redis_server: RedisServer) -> None:
    size = len(pl(0))
    a = OffloadCoordinator(
        [HostTier(LAYOUT, 10 * size, name="host"), RedisTier(redis_server.url, LAYOUT)]
    )
    b_host = HostTier(LAYOUT, 10 * size, name="host")
    b = OffloadCoordinator([b_host, RedisTier(redis_server.url, LAYOUT)])
    for i in range(5):
        a.submit(h(i), pl(i))
    assert a.flush(5)
    hashes = [h(i) for i in range(6)]
    assert b.match(hashes) == [("redis", h(i)) for i in range(5)]
    assert b.load(hashes) == [pl(i) for i in range(5)]
    assert b.flush(5)
    assert b_host.contains_prefix(hashes) == 5  # promoted into b's host tier
    redis_server.stop()
    assert b.contains_prefix(hashes) == 5  # b's host copy keeps serving
    assert a.submit(h(7), pl(7))  # a keeps accepting; the Redis write is dropped
    assert a.flush(5)
    redis_tier_stats = a.stats().tiers[1]
    assert redis_tier_stats.dropped_writes == 1
    a.close()
    b.close()


def test_bad_urls_raise_typed_errors() -> None:
    with pytest.raises(InvalidRequestError, match="scheme"):
        RedisTier("http://127.0.0.1:1/0", LAYOUT)
    with pytest.raises(InvalidRequestError, match="looks like"):
        RedisTier("127.0.0.1:6379", LAYOUT)
    with pytest.raises(TierUnavailableError, match="cluster"):
        RedisTier("redis+cluster://127.0.0.1:1", LAYOUT, connect_timeout_s=0.2)


def test_a_server_that_was_never_up_reads_as_misses() -> None:
    tier = RedisTier("redis://127.0.0.1:1/0", LAYOUT, connect_timeout_s=0.2)
    assert tier.contains_prefix([h(0)]) == 0
    assert not tier.put(h(0), pl(0))
    assert tier.stats().errors == 1
    with pytest.raises(TierUnavailableError):
        tier.health_check()
