"""KV events leaving the process: vLLM's ZeroMQ wire format, a publisher and a subscriber.

The core queues events in memory (:mod:`pagedkv.core.events`); the engine drains them after each
step and hands them to :class:`~pagedkv.kvevents.publisher.ZmqEventPublisher`; routers read them
with :class:`~pagedkv.kvevents.subscriber.EventSubscriber`. Only the configuration is
re-exported here, so building an engine config never imports pyzmq or msgspec.
"""

from pagedkv.kvevents.config import KVEventsConfig

__all__ = ["KVEventsConfig"]
