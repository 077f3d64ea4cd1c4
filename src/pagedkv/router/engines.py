"""The engines behind the router: their event streams, health, load and hashing parameters.

Each engine (an ``http://HOST:PORT`` base URL of a ``pagedkv serve --kv-events ...``) gets:

* a discovery of ``GET /kv_events`` (event endpoints, block size, model id, hash algorithm);
* an event thread: an :class:`EventSubscriber` applying its batches to the shared
  :class:`PrefixIndex` under the registry's lock, started from the engine's
  ``GET /kv_events/snapshot`` (its cached hashes as of batch ``S``, then the stream from
  ``S + 1``; an engine without the endpoint is replayed from batch 0 instead). A fresh
  subscriber and snapshot each time the engine comes back, since a restarted engine numbers
  from 0 again;
* a health and load poll of ``GET /metrics`` every ``poll_interval_s``: running + waiting
  requests; a failed poll (or a failed proxied request) takes the engine out and drops its
  index entries until a poll answers again; an engine that is out is re-probed every
  ``discovery_interval_s`` (default: the poll interval).

Membership changes at run time: :meth:`EngineRegistry.add` (joins at the next poll, with its
snapshot) and :meth:`EngineRegistry.remove` (out at once, its index entries dropped, its event
thread stopped; requests in flight there finish).

The registry's lock guards the index and every handle's mutable fields; nothing under it does
I/O, so the event loop never waits on the network while holding it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from pagedkv.core.hashing import HashAlgo, HashContext, hash_blocks
from pagedkv.kvevents.subscriber import EventSubscriber
from pagedkv.kvevents.wire import KVEventBatch, WireAllBlocksCleared, WireBlockStored
from pagedkv.route.index import PrefixIndex
from pagedkv.route.policy import EngineLoad
from pagedkv.router.state_file import EngineStateFile

logger = logging.getLogger(__name__)

_GAUGE = re.compile(
    r"^(pagedkv_requests_running|pagedkv_requests_waiting|vllm:num_requests_running|"
    r"vllm:num_requests_waiting)(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$",
    re.MULTILINE,
)


@dataclass(frozen=True, slots=True)
class HashSpec:
    """What decides an engine's block hashes; engines with equal specs share one hash set."""

    block_size: int
    model_id: str
    hash_algo: str

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        ctx = HashContext(
            model_id=self.model_id, cache_salt=cache_salt, algo=HashAlgo(self.hash_algo)
        )
        return hash_blocks(token_ids, self.block_size, ctx)


def parse_load(metrics_text: str) -> int:
    """Running + waiting requests from a Prometheus text page (pagedkv's or vLLM's names)."""
    total = 0.0
    seen: set[str] = set()
    for name, value in _GAUGE.findall(metrics_text):
        kind = name.rsplit("_", 1)[-1]  # running | waiting: count each kind once
        if kind not in seen:
            seen.add(kind)
            total += float(value)
    return int(total)


@dataclass(frozen=True, slots=True)
class EventsInfo:
    """An engine's ``GET /kv_events`` answer."""

    endpoint: str
    replay_endpoint: str | None
    topic: str
    spec: HashSpec
    num_batches_published: int


def _fetch_info(client: httpx.Client, url: str) -> EventsInfo | None:
    """The engine's event stream, or None when it publishes none (404). Raises httpx errors,
    and KeyError/TypeError/ValueError for a malformed answer."""
    resp = client.get(f"{url}/kv_events")
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    body = resp.json()
    replay = body["replay_endpoint"]
    return EventsInfo(
        str(body["endpoint"]),
        None if replay is None else str(replay),
        str(body["topic"]),
        HashSpec(int(body["block_size"]), str(body["model_id"]), str(body["hash_algo"])),
        int(body["num_batches_published"]),
    )


class EngineHandle:
    """One engine's state as the router sees it (fields guarded by the registry's lock)."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")
        self.healthy = False
        self.polled_load = 0
        self.in_flight = 0  # requests the router has sent and not yet finished
        self.spec: HashSpec | None = None
        self.num_failures = 0
        self.stream: tuple[str, str | None] | None = None  # the subscribed (endpoint, replay)
        self.num_published = -1  # the engine's batch count at the last poll
        self.num_event_batches = 0  # batches applied to the index (all subscriptions)
        self.num_missed_batches = 0  # of the current subscription: neither received nor replayed
        self._subscriber: EventSubscriber | None = None
        self.generation = 0  # bumps when the engine is taken out: stale event threads stop
        self.next_probe_s = 0.0  # monotonic time of the next poll while it is out
        self.num_snapshot_blocks = 0  # hashes of the last snapshot applied

    @property
    def load(self) -> int:
        """The larger of what the engine reported and what the router has in flight there
        (the router's own count covers the poll's lag)."""
        return max(self.polled_load, self.in_flight)


class EngineRegistry:
    """All engines, the shared prefix index, and the threads that keep both current."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        headers: dict[str, str] | None = None,
        poll_interval_s: float = 0.5,
        timeout_s: float = 2.0,
        discovery_interval_s: float | None = None,
        state: EngineStateFile | None = None,
    ) -> None:
        self.engines = {u.rstrip("/"): EngineHandle(u) for u in urls}
        self._state = state  # when set, every membership change is saved there first
        self.discovery_interval_s = (
            poll_interval_s if discovery_interval_s is None else discovery_interval_s
        )
        self.index: PrefixIndex[str] = PrefixIndex()
        self.lock = threading.Lock()
        self._headers = headers or {}
        self.poll_interval_s = poll_interval_s
        self._timeout_s = timeout_s
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        t = threading.Thread(target=self._poll_loop, name="pagedkv-router-poll", daemon=True)
        t.start()
        self._threads.append(t)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=5)

    def poll_once(self) -> None:
        """Poll every engine once (health, load; discovery and events for one that is back)."""
        with httpx.Client(timeout=self._timeout_s, headers=self._headers) as client:
            for handle in list(self.engines.values()):
                self._poll(client, handle)

    # ------------------------------------------------------------------ membership
    def add(self, url: str) -> bool:
        """Add an engine (it joins at the next poll); False if it is already listed. With a
        state file, the new membership is saved first: StateFileError changes nothing."""
        url = url.rstrip("/")
        with self.lock:
            if url in self.engines:
                return False
            self._save([*self.engines, url])
            self.engines[url] = EngineHandle(url)
        logger.info("engine %s added", url)
        return True

    def remove(self, url: str) -> bool:
        """Take an engine out for good: no routing, index entries dropped, event thread
        stopped. False if it is not listed. With a state file, the new membership is saved
        first: StateFileError changes nothing."""
        url = url.rstrip("/")
        with self.lock:
            if url not in self.engines:
                return False
            self._save([u for u in self.engines if u != url])
            handle = self.engines.pop(url)
            handle.healthy = False
            handle.generation += 1
            self.index.drop_engine(handle.url)
        logger.info("engine %s removed", url)
        return True

    def _save(self, urls: list[str]) -> None:
        """Save ``urls`` as the membership (caller holds ``lock``); raises StateFileError."""
        if self._state is not None:
            self._state.save(urls)

    def release(self, url: str) -> None:
        """One request the router sent to ``url`` finished (the engine may be gone since)."""
        with self.lock:
            handle = self.engines.get(url)
            if handle is not None:  # a re-added URL's new handle never counts below 0
                handle.in_flight = max(0, handle.in_flight - 1)

    # ------------------------------------------------------------------ queries
    def routable(self) -> list[EngineLoad[str]]:
        """Healthy engines and their load (hold ``lock``)."""
        return [EngineLoad(h.url, h.load) for h in self.engines.values() if h.healthy]

    def hash_spec(self) -> HashSpec | None:
        """The hash spec of the healthy engines when they agree (hold ``lock``); None if no
        engine is known yet or they disagree (then no prefix can be matched across them)."""
        specs = {h.spec for h in self.engines.values() if h.healthy and h.spec is not None}
        return specs.pop() if len(specs) == 1 else None

    def mark_failed(self, url: str, why: str) -> None:
        """Take an engine out: no more routing to it, its index entries dropped."""
        with self.lock:
            handle = self.engines.get(url)
            if handle is None:  # removed meanwhile
                return
            if handle.healthy:
                logger.warning("engine %s is out: %s", url, why)
            self._take_out(handle)

    def _take_out(self, handle: EngineHandle) -> None:
        handle.healthy = False
        handle.num_failures += 1
        handle.generation += 1
        self.index.drop_engine(handle.url)

    # ------------------------------------------------------------------ threads
    def _poll_loop(self) -> None:
        with httpx.Client(timeout=self._timeout_s, headers=self._headers) as client:
            while not self._stop.is_set():
                now = time.monotonic()
                with self.lock:
                    due = [h for h in self.engines.values() if h.healthy or h.next_probe_s <= now]
                for handle in due:
                    self._poll(client, handle)
                self._stop.wait(self.poll_interval_s)

    def _poll(self, client: httpx.Client, handle: EngineHandle) -> None:
        """One poll: load from ``/metrics``, the event stream from ``/kv_events``. An engine
        whose stream changed (new endpoints, or a publish count that went backwards: the
        process restarted) is taken out and rejoins at once with a fresh subscription."""
        try:
            resp = client.get(f"{handle.url}/metrics")
            resp.raise_for_status()
            load = parse_load(resp.text)
            info = _fetch_info(client, handle.url)
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            with self.lock:
                handle.next_probe_s = time.monotonic() + self.discovery_interval_s
            if handle.healthy:
                self.mark_failed(handle.url, f"poll failed: {exc}")
            return
        with self.lock:
            if self.engines.get(handle.url) is not handle:
                return  # removed while polling
            handle.polled_load = load
            stream = None if info is None else (info.endpoint, info.replay_endpoint)
            published = -1 if info is None else info.num_batches_published
            if handle.healthy and (stream != handle.stream or published < handle.num_published):
                logger.warning("engine %s restarted its event stream; resubscribing", handle.url)
                self._take_out(handle)
            handle.num_published = published
            if handle.healthy:
                return
            handle.spec = None if info is None else info.spec
            handle.stream = stream
            handle.healthy = True
            generation = handle.generation
        if info is None:
            logger.warning("engine %s publishes no KV events: routed by load only", handle.url)
            return
        logger.info("engine %s joined (events at %s)", handle.url, info.endpoint)
        t = threading.Thread(
            target=self._event_loop,
            args=(handle, generation, info.endpoint, info.replay_endpoint, info.topic),
            name=f"pagedkv-router-events-{handle.url}",
            daemon=True,
        )
        t.start()
        self._threads.append(t)

    def _event_loop(
        self, handle: EngineHandle, generation: int, endpoint: str, replay: str | None, topic: str
    ) -> None:
        sub = EventSubscriber(endpoint, replay, topic)  # subscribed before the snapshot is taken
        try:
            if not self._apply_snapshot(handle, generation, sub):
                return
            while not self._stop.is_set() and handle.generation == generation:
                batches = sub.poll(100)
                if batches:
                    with self.lock:
                        if handle.generation != generation:
                            return
                        for _, batch in batches:
                            self._apply(handle.url, batch)
                        handle.num_event_batches += len(batches)
                        handle.num_missed_batches = sub.num_missed
        finally:
            sub.close()

    def _apply_snapshot(self, handle: EngineHandle, generation: int, sub: EventSubscriber) -> bool:
        """Seed the index from ``GET /kv_events/snapshot`` and start ``sub`` after its seq.
        An engine without the endpoint (404) is replayed from batch 0; False when the
        snapshot cannot be read (the engine is taken out; the next poll retries)."""
        try:
            with httpx.Client(timeout=self._timeout_s, headers=self._headers) as client:
                resp = client.get(f"{handle.url}/kv_events/snapshot")
            if resp.status_code == 404:
                return True
            resp.raise_for_status()
            body = resp.json()
            seq = int(body["seq"])
            hashes = [bytes.fromhex(str(h)) for h in body["block_hashes"]]
            medium = str(body["medium"])
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            if handle.generation == generation:
                self.mark_failed(handle.url, f"snapshot failed: {exc}")
            return False
        with self.lock:
            if handle.generation != generation:
                return False
            self.index.store(handle.url, hashes, medium)
            handle.num_snapshot_blocks = len(hashes)
        sub.start_after(seq)
        return True

    def _apply(self, url: str, batch: KVEventBatch) -> None:
        """Apply one batch to the index (hold ``lock``)."""
        for event in batch.events:
            if isinstance(event, WireBlockStored):
                hashes = [h for h in event.block_hashes if isinstance(h, bytes)]
                self.index.store(url, hashes, event.medium)
            elif isinstance(event, WireAllBlocksCleared):
                self.index.clear(url, "GPU")
            else:
                hashes = [h for h in event.block_hashes if isinstance(h, bytes)]
                self.index.remove(url, hashes, event.medium)
