"""The Redis/Valkey tier: one key per block, shared by every engine that serves the same model.

Key: ``<namespace>:<hex hash>`` (namespace = format version + model id + layout, see
:class:`TierLayout`), value: the whole encoded payload. One key per block, never a K key and a V
key, so the server evicting a key under ``maxmemory`` loses a whole block, never half of one.

Writes are ``SET key payload NX [EX ttl]`` (the first engine to store a block wins; equal
hashes mean equal content), preceded by a pipelined ``EXISTS`` so a block another engine already
stored is not sent again. Reads and writes go in pipelines of bounded size (``batch_max_keys``
keys and about ``batch_max_bytes`` bytes per round trip). redis-py uses hiredis for parsing when
it is installed (``pip install 'redis[hiredis]'``).

Failure: a connection error or timeout marks the server down for a back-off period (doubling
from ``backoff_initial_s`` to ``backoff_max_s``); meanwhile lookups miss and writes are dropped
without touching the network, so the scheduler never waits on a dead server more than one
connect timeout per back-off period. Every failure is counted; nothing is raised to the caller
except from :meth:`RedisTier.health_check`. redis-py's own retries are disabled (we back off).

Cluster mode: a URL ``redis+cluster://host:port`` (or ``rediss+cluster://``) uses
``redis.cluster.RedisCluster``; pipelines then split by slot on the client. Tested against a
real 3-master cluster (``tests/e2e/test_redis_cluster.py``): keys spread over the masters, and a
master that stops turns lookups into counted misses (its slots, or every slot once the cluster
marks itself failed under ``cluster-require-full-coverage``) while the engine recomputes.

The back-off is one state for the whole cluster client, not per node: the first call that
touches a dead master's slot backs off the *whole* tier (the surviving masters' keys miss too),
and the next call touching a dead slot after the back-off renews it. Under Redis's default
``cluster-require-full-coverage yes`` that costs nothing extra (the survivors answer
CLUSTERDOWN for every slot about one node timeout after the master died); under ``no`` it
leaves the survivors unused until the master returns (docs/routing.md, "Redis Cluster").
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pagedkv.errors import (
    CorruptBlockError,
    InvalidRequestError,
    InvariantViolation,
    TierUnavailableError,
)
from pagedkv.tiers.base import KVTier, TierStats
from pagedkv.tiers.payload import TierLayout, decode, payload_size, read_header
from pagedkv.tiers.urls import redact_url

logger = logging.getLogger(__name__)

T = TypeVar("T")
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_TRANSIENT = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


def make_client(url: str, socket_timeout_s: float, connect_timeout_s: float) -> Any:
    """A redis-py client for ``url`` (``RedisCluster`` for a ``redis+cluster://`` URL).

    A single-node client connects lazily (a dead server shows up as misses later); a cluster
    client must reach a node now and raises TierUnavailableError if it cannot."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise InvalidRequestError(
            f"a Redis URL looks like redis://host:6379/0, got {redact_url(url)!r}"
        )
    opts: dict[str, Any] = {
        "socket_timeout": socket_timeout_s,
        "socket_connect_timeout": connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    if scheme in _CLUSTER_SCHEMES:
        from redis.cluster import RedisCluster

        try:  # a cluster client asks a node for the slot map when it is built
            return RedisCluster.from_url(f"{_CLUSTER_SCHEMES[scheme]}://{rest}", **opts)
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            shown = redact_url(url)
            raise TierUnavailableError(f"Redis cluster at {shown} is unreachable: {exc}") from exc
    if scheme not in ("redis", "rediss", "unix"):
        raise InvalidRequestError(f"unsupported Redis URL scheme {scheme!r} in {redact_url(url)!r}")
    return redis.Redis.from_url(url, **opts)


class RedisTier(KVTier):
    """Block payloads in a Redis or Valkey server (or cluster), shared across engines.

    Invariants (check_invariants() verifies each):
      I1  initial back-off <= current back-off <= maximum back-off
      I2  not down (no back-off deadline) => the back-off is back at its initial value
    Complexity: contains_prefix and get_many one round trip per batch; put_many two (EXISTS,
    then SET NX for the absent ones); nothing scans the server.
    """

    is_remote = True

    def __init__(
        self,
        url: str,
        layout: TierLayout,
        *,
        ttl_s: int | None = None,
        batch_max_keys: int = 64,
        batch_max_bytes: int = 64 << 20,
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        client: Any = None,
        name: str = "redis",
    ) -> None:
        if ttl_s is not None and ttl_s <= 0:
            raise InvalidRequestError(f"ttl_s must be positive or None, got {ttl_s}")
        if batch_max_keys <= 0 or batch_max_bytes <= 0:
            raise InvalidRequestError("batch_max_keys and batch_max_bytes must be positive")
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise InvalidRequestError(
                f"need 0 < backoff_initial_s <= backoff_max_s, got {backoff_initial_s}, "
                f"{backoff_max_s}"
            )
        super().__init__(name, layout)
        self.url = redact_url(url)  # for logs and errors: the password never shows
        self.ttl_s = ttl_s
        self.batch_max_keys = batch_max_keys
        self.batch_max_bytes = batch_max_bytes
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._clock = clock
        self._client = client or make_client(url, socket_timeout_s, connect_timeout_s)
        self._prefix = (layout.namespace + ":").encode("utf-8")
        self._backoff_s = backoff_initial_s
        self._down_until: float | None = None  # I1
        # keys per GET batch so one response stays near batch_max_bytes
        per = max(1, batch_max_bytes // payload_size(layout))
        self._get_batch = min(batch_max_keys, per)

    def key_of(self, block_hash: bytes) -> bytes:
        return self._prefix + block_hash.hex().encode("ascii")

    # ------------------------------------------------------------------ failure handling
    def is_down(self) -> bool:
        """True during a back-off period after a connection failure."""
        with self._lock:
            return self._is_down()

    def _is_down(self) -> bool:
        return self._down_until is not None and self._clock() < self._down_until

    def _call(self, fn: Callable[[Any], T], *, force: bool = False) -> tuple[bool, T | None]:
        """Run ``fn(client)``; (True, result), or (False, None) after a counted failure or
        while backing off (unless ``force``)."""
        with self._lock:
            if self._is_down() and not force:
                return False, None
        try:
            result = fn(self._client)
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException) as exc:
            self._failed(exc)
            return False, None
        except OSError as exc:
            self._failed(exc)
            return False, None
        with self._lock:
            if self._down_until is not None:
                logger.info("redis tier %s: reachable again", self.url)
            self._down_until = None
            self._backoff_s = self.backoff_initial_s
        return True, result

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            self._counters.errors += 1
            if not isinstance(exc, _TRANSIENT):
                logger.warning("redis tier %s: %s: %s", self.url, type(exc).__name__, exc)
                return
            if self._down_until is None:
                logger.warning(
                    "redis tier %s unreachable (%s); lookups miss and writes are dropped, "
                    "retrying in %.1f s",
                    self.url,
                    exc,
                    self._backoff_s,
                )
            self._down_until = self._clock() + self._backoff_s
            self._backoff_s = min(self._backoff_s * 2, self.backoff_max_s)

    def health_check(self) -> None:
        """PING the server now (ignoring the back-off); raise TierUnavailableError if it fails."""
        ok, _ = self._call(lambda c: c.ping(), force=True)
        if not ok:
            raise TierUnavailableError(f"Redis/Valkey at {self.url} does not answer PING")

    # ------------------------------------------------------------------ reads
    @staticmethod
    def _chunks(seq: Sequence[T], size: int) -> Iterator[Sequence[T]]:
        for i in range(0, len(seq), size):
            yield seq[i : i + size]

    def contains_prefix(self, block_hashes: Sequence[bytes]) -> int:
        n = 0
        for chunk in self._chunks(block_hashes, self.batch_max_keys):
            keys = [self.key_of(h) for h in chunk]

            def exists(c: Any, keys: list[bytes] = keys) -> list[int]:
                pipe = c.pipeline(transaction=False)
                for k in keys:
                    pipe.exists(k)
                return list(pipe.execute())

            ok, found = self._call(exists)
            if not ok or found is None:
                break
            run = next((i for i, f in enumerate(found) if not f), len(found))
            n += run
            if run < len(found):
                break
        with self._lock:
            self._counters.record_lookup(len(block_hashes), n)
        return n

    def try_get(self, block_hash: bytes) -> bytes | None:
        return self.get_many((block_hash,))[0]

    def get_many(self, block_hashes: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        corrupt: list[bytes] = []
        for chunk in self._chunks(block_hashes, self._get_batch):
            keys = [self.key_of(h) for h in chunk]

            def get(c: Any, keys: list[bytes] = keys) -> list[bytes | None]:
                pipe = c.pipeline(transaction=False)
                for k in keys:
                    pipe.get(k)
                return list(pipe.execute())

            ok, values = self._call(get)
            if not ok or values is None:
                out.extend([None] * len(chunk))
                continue
            for h, value in zip(chunk, values, strict=True):
                if value is None:
                    out.append(None)
                    continue
                try:
                    decode(value, self.layout, h)
                except CorruptBlockError as exc:
                    logger.warning("redis tier: block %s is corrupt: %s", h.hex(), exc)
                    corrupt.append(h)
                    out.append(None)
                    continue
                out.append(bytes(value))
        if corrupt:
            keys = [self.key_of(h) for h in corrupt]
            self._call(lambda c: c.delete(*keys))
        num_hits = sum(v is not None for v in out)
        with self._lock:
            self._counters.hits += num_hits
            self._counters.misses += len(out) - num_hits
            self._counters.corrupt += len(corrupt)
            self._counters.bytes_out += sum(len(v) for v in out if v is not None)
        return out

    # ------------------------------------------------------------------ writes
    def put(self, block_hash: bytes, payload: bytes) -> bool:
        return self.put_many(((block_hash, payload),)) == 1

    def _write_batches(
        self, items: list[tuple[bytes, bytes]]
    ) -> Iterator[list[tuple[bytes, bytes]]]:
        batch: list[tuple[bytes, bytes]] = []
        size = 0
        for item in items:
            if batch and (
                len(batch) >= self.batch_max_keys or size + len(item[1]) > self.batch_max_bytes
            ):
                yield batch
                batch, size = [], 0
            batch.append(item)
            size += len(item[1])
        if batch:
            yield batch

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> int:
        todo = list(items)
        for h, p in todo:
            header = read_header(p)
            if header.layout != self.layout or header.block_hash != h:
                raise InvalidRequestError(
                    f"payload for block {header.block_hash.hex()} ({header.layout.namespace}) "
                    f"cannot be stored as {h.hex()} in tier {self.layout.namespace}"
                )
        stored = 0
        for batch in self._write_batches(todo):
            keys = [self.key_of(h) for h, _ in batch]

            def write(
                c: Any, batch: list[tuple[bytes, bytes]] = batch, keys: list[bytes] = keys
            ) -> tuple[int, int]:
                pipe = c.pipeline(transaction=False)
                for k in keys:
                    pipe.exists(k)
                present = pipe.execute()
                pipe = c.pipeline(transaction=False)
                sent = 0
                for k, (_, p), there in zip(keys, batch, present, strict=True):
                    if not there:
                        pipe.set(k, p, nx=True, ex=self.ttl_s)
                        sent += len(p)
                if sent:
                    pipe.execute()
                return len(batch), sent

            ok, res = self._call(write)
            with self._lock:
                if ok and res is not None:
                    stored += res[0]
                    self._counters.bytes_in += res[1]
                    for h, _ in batch:  # stored now or already there: the server holds it
                        self._event_stored(h)
                else:
                    self._counters.dropped_writes += len(batch)
        return stored

    def delete(self, block_hash: bytes) -> bool:
        ok, n = self._call(lambda c: c.delete(self.key_of(block_hash)))
        if ok and n:
            with self._lock:
                self._event_removed(block_hash)
        return bool(ok and n)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> TierStats:
        with self._lock:
            return self._counters.snapshot(self.name, None, None, None)

    def check_invariants(self) -> None:
        with self._lock:
            if not self.backoff_initial_s <= self._backoff_s <= self.backoff_max_s:
                raise InvariantViolation(
                    f"I1: back-off {self._backoff_s} outside [{self.backoff_initial_s}, "
                    f"{self.backoff_max_s}]"
                )
            if self._down_until is None and self._backoff_s != self.backoff_initial_s:
                raise InvariantViolation(f"I2: not down but back-off is {self._backoff_s}")

    def close(self) -> None:
        try:
            self._client.close()
        except (redis.exceptions.RedisError, OSError) as exc:  # closing a dead socket
            logger.debug("redis tier: close failed: %s", exc)
