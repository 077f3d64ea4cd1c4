"""The Redis/Valkey tier: one key per block, shared by every engine that serves the same model.

Key: ``<namespace>:<hex hash>`` (namespace = format version + model id + layout, see
:class:`TierLayout`), value: the whole encoded payload. One key per block, never a K key and a V
key, so the server evicting a key under ``maxmemory`` loses a whole block, never half of one.

Writes are ``SET key payload NX [EX ttl]`` (the first engine to store a block wins; equal
hashes mean equal content), preceded by a pipelined ``EXISTS`` so a block another engine already
stored is not sent again. Reads and writes go in pipelines of bounded size (``batch_max_keys``
keys and about ``batch_max_bytes`` bytes per round trip). redis-py uses hiredis for parsing when
it is installed (``pip install 'redis[hiredis]'``).

Failure, per node: a connection error, a timeout or a ``CLUSTERDOWN`` reply puts *that node* in
back-off (doubling from ``backoff_initial_s`` to ``backoff_max_s``,
:class:`~pagedkv.tiers.node_health.NodeBackoff`). Meanwhile the keys it serves miss and their
writes are dropped without touching the network; every other node keeps serving. For a single
server that node is the whole tier; for a cluster it is one master and the slots it serves. The
first operation after a node's back-off touches it again (the re-probe). So the scheduler never
waits on a dead node more than one connect timeout per back-off period. Every failure is
counted; nothing is raised to the caller except from :meth:`RedisTier.health_check`. redis-py's
own retries are disabled (we back off).

Cluster mode: a URL ``redis+cluster://host:port`` (or ``rediss+cluster://``) uses
``redis.cluster.RedisCluster`` for the slot map and each master's own client; each operation
sends one pipeline per master (:mod:`pagedkv.tiers.redis_nodes`). A node failure, a
``MOVED``/``ASK`` reply or an uncovered slot refreshes the slot map before the next operation,
so a failover is followed. Tested against a real 3-master cluster
(``tests/e2e/test_redis_cluster.py``): with ``cluster-require-full-coverage no`` a stopped
master's keys miss while the other masters' keys keep hitting, and hits on it resume after its
back-off once it is back; under Redis's default ``cluster-require-full-coverage yes`` the
survivors themselves answer ``CLUSTERDOWN`` for every slot about one node timeout after the
master died, so every key misses until it returns (or its replica takes over: the refreshed slot
map then sends its keys there) (docs/routing.md, "Redis Cluster").
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
    TierUnavailableError,
)
from pagedkv.tiers.base import KVTier, TierStats
from pagedkv.tiers.node_health import NodeBackoff
from pagedkv.tiers.payload import TierLayout, decode, payload_size, read_header
from pagedkv.tiers.redis_nodes import ClusterNodes, SingleNode, is_topology_error
from pagedkv.tiers.urls import redact_url

logger = logging.getLogger(__name__)

T = TypeVar("T")
_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
# failures that put a node in back-off: it is unreachable, or refuses every slot (CLUSTERDOWN)
_TRANSIENT = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    OSError,
)
_FAILURES = (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError)


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
      I1, I2  of the per-node back-off (:class:`~pagedkv.tiers.node_health.NodeBackoff`)
    A key's result comes only from the node the slot map names for it, so a node in back-off
    changes nothing for the keys of the other nodes.
    Complexity: contains_prefix and get_many one round trip per batch and node; put_many two
    (EXISTS, then SET NX for the absent ones); nothing scans the server.
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
        health = NodeBackoff(backoff_initial_s, backoff_max_s, clock)  # validates the pair
        super().__init__(name, layout)
        self.url = redact_url(url)  # for logs and errors: the password never shows
        self.ttl_s = ttl_s
        self.batch_max_keys = batch_max_keys
        self.batch_max_bytes = batch_max_bytes
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self._client = client or make_client(url, socket_timeout_s, connect_timeout_s)
        self._health = health  # guarded by _lock
        self._nodes: SingleNode | ClusterNodes
        from redis.cluster import RedisCluster

        if isinstance(self._client, RedisCluster):
            self._nodes = ClusterNodes(self._client, backoff_initial_s, clock)
        else:
            self._nodes = SingleNode(self._client, self.url)
        self._prefix = (layout.namespace + ":").encode("utf-8")
        # keys per GET batch so one response stays near batch_max_bytes
        per = max(1, batch_max_bytes // payload_size(layout))
        self._get_batch = min(batch_max_keys, per)

    def key_of(self, block_hash: bytes) -> bytes:
        return self._prefix + block_hash.hex().encode("ascii")

    # ------------------------------------------------------------------ failure handling
    def is_down(self) -> bool:
        """True while some node (the server, or a cluster master) is in back-off."""
        with self._lock:
            return self._health.any_down()

    def down_nodes(self) -> list[str]:
        """The nodes (``host:port``; the URL for a single server) in back-off now, sorted."""
        with self._lock:
            return self._health.down_names()

    def _run(
        self, keys: Sequence[bytes], fn: Callable[[Any, list[bytes]], Sequence[T]]
    ) -> list[T | None]:
        """``fn(node_client, node_keys)`` once per node that serves some of ``keys``; returns
        the per-key results in ``keys`` order, None where the node is in back-off, failed or
        is not known (a counted failure). Never raises a Redis error."""
        out: list[T | None] = [None] * len(keys)
        try:  # the slot map's own locks; a refresh is network I/O, so not under ours
            self._nodes.refresh_if_requested()
            groups, _ = self._nodes.groups(keys)
        except _FAILURES as exc:
            with self._lock:
                self._counters.errors += 1
            logger.warning("redis tier %s: slot map unavailable: %s", self.url, exc)
            return out
        with self._lock:
            groups = [g for g in groups if not self._health.is_down(g.name)]
        for group in groups:
            try:
                results = fn(group.client, [keys[i] for i in group.indices])
            except _FAILURES as exc:
                self._failed(group.name, exc)
                continue
            with self._lock:
                if self._health.succeeded(group.name):
                    logger.info("redis tier %s: node %s reachable again", self.url, group.name)
            for i, r in zip(group.indices, results, strict=True):
                out[i] = r
        return out

    def _failed(self, node: str, exc: Exception) -> None:
        with self._lock:
            self._counters.errors += 1
            if is_topology_error(exc):
                self._nodes.request_refresh()
                logger.info("redis tier %s: %s (slot map stale): %s", self.url, node, exc)
                return
            if not isinstance(exc, _TRANSIENT):
                logger.warning("redis tier %s: %s: %s: %s", self.url, node, type(exc).__name__, exc)
                return
            self._nodes.request_refresh()  # a replica may be taking over its slots
            was_down = node in self._health.down_names()
            wait = self._health.failed(node)
            if not was_down:
                logger.warning(
                    "redis tier %s: node %s unavailable (%s); its keys miss and their writes "
                    "are dropped, retrying in %.1f s",
                    self.url,
                    node,
                    exc,
                    wait,
                )

    def health_check(self) -> None:
        """PING the server (every master of a cluster, each on its own connection) now,
        ignoring the back-off; raise TierUnavailableError naming those that do not answer.
        Each answer clears that node's back-off, each failure counts and backs it off."""
        try:
            masters = self._nodes.masters()
        except _FAILURES as exc:
            with self._lock:
                self._counters.errors += 1
            raise TierUnavailableError(f"Redis/Valkey at {self.url}: no slot map: {exc}") from exc
        dead: list[str] = []
        for name, client in masters:
            try:
                client.ping()
            except _FAILURES as exc:
                self._failed(name, exc)
                dead.append(f"{name} ({exc})")
                continue
            with self._lock:
                self._health.succeeded(name)
        if dead:
            raise TierUnavailableError(
                f"Redis/Valkey at {self.url}: no answer to PING from {', '.join(dead)}"
            )

    # ------------------------------------------------------------------ reads
    @staticmethod
    def _chunks(seq: Sequence[T], size: int) -> Iterator[Sequence[T]]:
        for i in range(0, len(seq), size):
            yield seq[i : i + size]

    @staticmethod
    def _exists(c: Any, keys: list[bytes]) -> list[int]:
        pipe = c.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        return list(pipe.execute())

    @staticmethod
    def _get(c: Any, keys: list[bytes]) -> list[bytes | None]:
        pipe = c.pipeline(transaction=False)
        for k in keys:
            pipe.get(k)
        return list(pipe.execute())

    def contains_prefix(self, block_hashes: Sequence[bytes]) -> int:
        n = 0
        for chunk in self._chunks(block_hashes, self.batch_max_keys):
            found = self._run([self.key_of(h) for h in chunk], self._exists)
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
            values = self._run([self.key_of(h) for h in chunk], self._get)
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
            self._run([self.key_of(h) for h in corrupt], self._delete)
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
            payload_of = {self.key_of(h): p for h, p in batch}

            def write(
                c: Any, keys: list[bytes], payload_of: dict[bytes, bytes] = payload_of
            ) -> list[int]:
                """Per key: the bytes sent (0 if another engine stored it first)."""
                present = self._exists(c, keys)
                pipe = c.pipeline(transaction=False)
                sent = [
                    0 if there else len(payload_of[k])
                    for k, there in zip(keys, present, strict=True)
                ]
                for k, n in zip(keys, sent, strict=True):
                    if n:
                        pipe.set(k, payload_of[k], nx=True, ex=self.ttl_s)
                if any(sent):
                    pipe.execute()
                return sent

            results = self._run(list(payload_of), write)
            with self._lock:
                for (h, _), sent in zip(batch, results, strict=True):
                    if sent is None:
                        self._counters.dropped_writes += 1
                        continue
                    stored += 1  # stored now or already there: the server holds it
                    self._counters.bytes_in += sent
                    self._event_stored(h)
        return stored

    @staticmethod
    def _delete(c: Any, keys: list[bytes]) -> list[int]:
        pipe = c.pipeline(transaction=False)
        for k in keys:
            pipe.delete(k)
        return list(pipe.execute())

    def delete(self, block_hash: bytes) -> bool:
        (n,) = self._run([self.key_of(block_hash)], self._delete)
        if n:
            with self._lock:
                self._event_removed(block_hash)
        return bool(n)

    # ------------------------------------------------------------------ reporting
    def stats(self) -> TierStats:
        with self._lock:
            return self._counters.snapshot(self.name, None, None, None)

    def check_invariants(self) -> None:
        with self._lock:
            self._health.check_invariants()

    def close(self) -> None:
        try:
            self._client.close()
        except (redis.exceptions.RedisError, OSError) as exc:  # closing a dead socket
            logger.debug("redis tier: close failed: %s", exc)
