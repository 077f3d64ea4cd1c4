"""Which Redis node serves which key: one group for a single server, one per master in a cluster.

The Redis tier runs each operation as one pipeline per node so that a node that fails costs only
the keys it serves (:mod:`pagedkv.tiers.node_health`). For a cluster the slot map is redis-py's
own (``RedisCluster.get_node_from_key``: CRC16 of the key modulo 16384, then the nodes manager's
slot cache), and each group is sent on that node's own ``Redis`` client
(``RedisCluster.get_redis_connection``), which has redis-py's retries disabled.

The slot map is refreshed (``nodes_manager.initialize()``, which asks a reachable node for
``CLUSTER SLOTS``) when the tier has seen a sign that the topology changed: a node failure (a
replica may take over its slots), a ``MOVED``/``ASK`` reply, a ``CLUSTERDOWN`` reply, or a key
whose slot the map does not cover. Refreshes are at most one per ``min_refresh_interval_s``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from pagedkv.errors import InvalidRequestError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class NodeGroup:
    """The keys of one operation that one node serves."""

    name: str  # the node's ``host:port`` (the redacted URL for a single server)
    client: Any  # a redis-py ``Redis`` client talking to that node only
    indices: tuple[int, ...]  # positions in the operation's key list, ascending


class SingleNode:
    """A single server: every key is in the one group."""

    def __init__(self, client: Any, name: str) -> None:
        self.client = client
        self.name = name

    def groups(self, keys: Sequence[bytes]) -> tuple[list[NodeGroup], list[int]]:
        """(groups, indices of keys no node serves): here one group and no orphans."""
        if not keys:
            return [], []
        return [NodeGroup(self.name, self.client, tuple(range(len(keys))))], []

    def masters(self) -> list[tuple[str, Any]]:
        """(name, client) of every node that serves keys: here the one server."""
        return [(self.name, self.client)]

    def request_refresh(self) -> None:
        """A single server has no slot map."""

    def refresh_if_requested(self) -> None:
        """A single server has no slot map."""


class ClusterNodes:
    """A Redis Cluster's masters, found from redis-py's slot map.

    Invariant: a refresh runs only when one was requested, at most once per
    ``min_refresh_interval_s`` (a dead node is re-probed once per back-off period, so a dead
    master does not turn every operation into a topology query), and by one thread at a time:
    a thread that finds a refresh under way goes on with the current map. Thread-safe (its
    own lock; redis-py's nodes manager guards its slot cache).
    """

    def __init__(
        self, client: Any, min_refresh_interval_s: float, clock: Callable[[], float]
    ) -> None:
        if min_refresh_interval_s <= 0:
            raise InvalidRequestError(
                f"min_refresh_interval_s must be positive, got {min_refresh_interval_s}"
            )
        self.client = client
        self.min_refresh_interval_s = min_refresh_interval_s
        self._clock = clock
        self._lock = threading.Lock()  # guards the three fields below
        self._refreshing = False
        self._refresh_requested = False
        self._last_refresh: float | None = None
        self.num_refreshes = 0  # slot-map refreshes that completed

    def groups(self, keys: Sequence[bytes]) -> tuple[list[NodeGroup], list[int]]:
        """(groups by master, indices of keys whose slot the map does not cover)."""
        by_node: dict[str, tuple[Any, list[int]]] = {}
        orphans: list[int] = []
        for i, key in enumerate(keys):
            try:
                node = self.client.get_node_from_key(key)
            except redis.exceptions.SlotNotCoveredError:
                orphans.append(i)
                continue
            entry = by_node.get(node.name)
            if entry is None:
                entry = by_node[node.name] = (node, [])
            entry[1].append(i)
        if orphans:
            self.request_refresh()
        out = [
            NodeGroup(name, self.client.get_redis_connection(node), tuple(idx))
            for name, (node, idx) in by_node.items()
        ]
        return out, orphans

    def masters(self) -> list[tuple[str, Any]]:
        """(name, client) of every master in the slot map."""
        return [(n.name, self.client.get_redis_connection(n)) for n in self.client.get_primaries()]

    def request_refresh(self) -> None:
        """Ask for a slot-map refresh before the next operation."""
        with self._lock:
            self._refresh_requested = True

    def refresh_if_requested(self) -> None:
        """Refresh the slot map if asked to, not refreshed within the interval and no other
        thread is refreshing it (the query runs outside the lock).

        Raises what redis-py raises when no node answers (the caller counts it)."""
        with self._lock:
            if not self._refresh_requested or self._refreshing:
                return
            now = self._clock()
            last = self._last_refresh
            if last is not None and now - last < self.min_refresh_interval_s:
                return
            self._last_refresh = now
            self._refresh_requested = False
            self._refreshing = True
        try:
            self.client.nodes_manager.initialize()
        finally:
            with self._lock:
                self._refreshing = False
        with self._lock:
            self.num_refreshes += 1
        logger.info("redis tier: cluster slot map refreshed")


def is_topology_error(exc: Exception) -> bool:
    """A reply that says the slot map is stale (``MOVED``, ``ASK``)."""
    return isinstance(exc, redis.exceptions.AskError)  # MovedError derives from AskError
