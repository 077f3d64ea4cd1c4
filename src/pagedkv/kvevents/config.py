"""The KV-event section of the configuration (``--kv-events``); importing it needs no pyzmq."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """Where and how KV events are published (``--kv-events``).

    ``endpoint`` is bound (``tcp://HOST:PORT``; ``PORT`` may be ``*`` for a free port, read
    back from :attr:`ZmqEventPublisher.endpoint`). ``replay_endpoint`` defaults to the same host
    on ``PORT + 1`` (or ``*``); ``""`` turns replay off. ``buffer_steps`` batches are kept for
    replay; ``max_queue_batches`` bound the queue in front of the publisher thread; ``hwm`` is
    the PUB socket's high-water mark (messages held per slow subscriber).
    """

    endpoint: str
    replay_endpoint: str | None = None
    topic: str = "kv-events"
    buffer_steps: int = 10_000
    max_queue_batches: int = 10_000
    hwm: int = 100_000
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise InvalidRequestError(
                f"--kv-events wants tcp://HOST:PORT (or ipc://, inproc://), got {self.endpoint!r}"
            )
        if min(self.buffer_steps, self.max_queue_batches, self.hwm) <= 0:
            raise InvalidRequestError("buffer_steps, max_queue_batches and hwm must be positive")

    def resolved_replay_endpoint(self) -> str | None:
        if self.replay_endpoint is not None:
            return self.replay_endpoint or None
        if not self.endpoint.startswith("tcp://"):
            return self.endpoint + "-replay"
        host, _, port = self.endpoint.rpartition(":")
        if port == "*":
            return self.endpoint
        if not port.isdigit():
            raise InvalidRequestError(f"--kv-events {self.endpoint!r} has no port")
        return f"{host}:{int(port) + 1}"
