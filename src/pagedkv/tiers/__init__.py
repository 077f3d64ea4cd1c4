"""KV tiers: block payloads in host RAM, on local disk and in Redis/Valkey, and the offload
coordinator in front of them. ``RedisTier`` lives in :mod:`pagedkv.tiers.redis_tier` (it needs the
optional ``redis`` package) and is imported from there."""

from pagedkv.tiers.base import KVTier, TierStats
from pagedkv.tiers.config import (
    TierConfig,
    add_tier_arguments,
    build_offload,
    parse_bytes,
    tier_config_from_args,
)
from pagedkv.tiers.disk import DiskTier
from pagedkv.tiers.disk_files import FsyncPolicy
from pagedkv.tiers.host import HostTier
from pagedkv.tiers.offload import PENDING, OffloadCoordinator, OffloadStats
from pagedkv.tiers.payload import (
    FORMAT_VERSION,
    BlockPayload,
    PayloadHeader,
    TierLayout,
    decode,
    encode,
    payload_size,
    read_header,
)

__all__ = [
    "FORMAT_VERSION",
    "PENDING",
    "BlockPayload",
    "DiskTier",
    "FsyncPolicy",
    "HostTier",
    "KVTier",
    "OffloadCoordinator",
    "OffloadStats",
    "PayloadHeader",
    "TierConfig",
    "TierLayout",
    "TierStats",
    "add_tier_arguments",
    "build_offload",
    "decode",
    "encode",
    "parse_bytes",
    "payload_size",
    "read_header",
    "tier_config_from_args",
]
