"""KV cache events out of the engine: the device pool's and each tier's, one batch per step, to a
ZMQ publisher (``EngineConfig.kv_events``; vLLM's ``--kv-events-config``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.core.block_pool import BlockPool
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.tier_io import TierIO

if TYPE_CHECKING:
    from pagedkv.kvevents.publisher import ZmqEventPublisher


def start_kv_events(config: EngineConfig, tier_io: TierIO | None) -> ZmqEventPublisher | None:
    """The publisher (None with KV events off); the tiers start recording their events."""
    if config.kv_events is None:
        return None
    from pagedkv.kvevents.publisher import ZmqEventPublisher  # needs pyzmq, msgspec

    if tier_io is not None:
        for tier in tier_io.offload.tiers:
            tier.enable_events()
    return ZmqEventPublisher(config.kv_events)


def publish_kv_events(
    publisher: ZmqEventPublisher, pool: BlockPool, tier_io: TierIO | None
) -> None:
    """Hand the pool's events, then each tier's, to the publisher as one batch (it never
    blocks; a full queue drops the batch and counts it). Tier events written by the
    offload thread between steps go out with the next step's batch."""
    events = pool.drain_events()
    if tier_io is not None:
        for tier in tier_io.offload.tiers:
            events.extend(tier.drain_events())
    publisher.publish(events)


def kv_events_snapshot(
    publisher: ZmqEventPublisher, pool: BlockPool, tier_io: TierIO | None
) -> tuple[int, list[bytes]]:
    """``(seq, hashes)``: the device pool's cached block hashes as of event batch ``seq``
    (pending events are published first, so every change so far is in a batch <= seq and
    none after it). Call between steps."""
    publish_kv_events(publisher, pool, tier_io)
    hashes = [pool.block_hash(i) for i in range(pool.num_materialized_blocks)]
    return publisher.last_seq, [h for h in hashes if h is not None]
