"""The core: block hashing, the block pool and the KV cache manager (numpy and xxhash only)."""

from pagedkv.core.block_pool import NULL_BLOCK_ID, BlockPool
from pagedkv.core.config import CacheConfig, ReservationPolicy
from pagedkv.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from pagedkv.core.eviction import EvictionPolicy, LRUPolicy
from pagedkv.core.hashing import (
    BlockHash,
    BlockHashChain,
    HashAlgo,
    HashContext,
    MultiModalItem,
    RangeKey,
    hash_blocks,
)
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.pool_config import PoolConfig
from pagedkv.core.seq_state import Allocation, PrefixMatch
from pagedkv.core.stats import KVCacheStats, PrefixSnapshot

__all__ = [
    "NULL_BLOCK_ID",
    "AllBlocksCleared",
    "Allocation",
    "BlockHash",
    "BlockHashChain",
    "BlockPool",
    "BlockRemoved",
    "BlockStored",
    "CacheConfig",
    "EvictionPolicy",
    "HashAlgo",
    "HashContext",
    "KVCacheManager",
    "KVCacheStats",
    "KVEvent",
    "LRUPolicy",
    "MultiModalItem",
    "PoolConfig",
    "PrefixMatch",
    "PrefixSnapshot",
    "RangeKey",
    "ReservationPolicy",
    "hash_blocks",
]
