"""KV events on the wire: vLLM's ``KVEventBatch`` encoding, and the conversion from core events.

The format is vLLM's ZeroMQ KV-event stream as its documented subscriber
(``examples/online_serving/kv_events_subscriber.py``) declares it: msgpack, every struct
``array_like`` (a msgpack array in field order), events tagged by class name as their first
element, defaults omitted at the end::

    KVEventBatch   = [ts, [event, ...], data_parallel_rank]
    BlockStored    = ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
                      lora_id, medium, (lora_name)]
    BlockRemoved   = ["BlockRemoved", block_hashes, medium]
    AllBlocksCleared = ["AllBlocksCleared"]

Block hashes are pagedkv's own (16 bytes for xxh3-128, 32 for sha256) sent as msgpack ``bin``:
vLLM's ``ExternalBlockHash`` is ``bytes | int``. ``lora_name`` trails the six documented
``BlockStored`` fields and is omitted when ``None``, so a decoder of the six-field struct still
reads every batch (msgspec ignores extra trailing array elements).

Media: the device pool publishes ``"GPU"`` (vLLM's name for an engine's primary KV pool, which
routers filter on, also on a CPU host); the tiers publish ``"cpu"`` (host RAM), ``"disk"`` and
``"redis"``.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

MEDIUM_DEVICE = "GPU"
"""The wire medium of the device pool (core medium ``"device"``)."""

_MEDIA = {"device": MEDIUM_DEVICE, "host": "cpu", "disk": "disk", "redis": "redis"}

ExternalBlockHash = bytes | int


class WireEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event structs (the tag is the class name)."""


class WireBlockStored(WireEvent, tag="BlockStored"):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None = None


class WireBlockRemoved(WireEvent, tag="BlockRemoved"):
    block_hashes: list[ExternalBlockHash]
    medium: str | None


class WireAllBlocksCleared(WireEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message: the events drained after one engine step, oldest first."""

    ts: float
    events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]
    data_parallel_rank: int | None = None


def wire_medium(medium: str) -> str:
    """The wire name of a core or tier medium (``device`` -> ``GPU``, ``host`` -> ``cpu``)."""
    return _MEDIA.get(medium, medium)


def to_wire(event: KVEvent) -> WireBlockStored | WireBlockRemoved | WireAllBlocksCleared:
    """The wire struct of one core event, field by field."""
    if isinstance(event, BlockStored):
        return WireBlockStored(
            block_hashes=list(event.block_hashes),
            parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=None,
            medium=wire_medium(event.medium),
            lora_name=event.lora_name,
        )
    if isinstance(event, BlockRemoved):
        return WireBlockRemoved(list(event.block_hashes), wire_medium(event.medium))
    if isinstance(event, AllBlocksCleared):
        return WireAllBlocksCleared()
    raise TypeError(f"not a KV event: {type(event).__name__}")  # pragma: no cover - typed union


def make_batch(
    events: Iterable[KVEvent], ts: float, data_parallel_rank: int | None = 0
) -> KVEventBatch:
    return KVEventBatch(ts, [to_wire(e) for e in events], data_parallel_rank)


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload; raises ``msgspec.DecodeError`` (a ``ValueError``) on a bad one."""
    return _DECODER.decode(payload)
