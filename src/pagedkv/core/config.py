"""Configuration of the KV cache manager (the core's section of the engine config)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pagedkv.core.hashing import HashAlgo
from pagedkv.core.pool_config import PoolConfig
from pagedkv.errors import InvalidRequestError


class ReservationPolicy(Enum):
    """How many future blocks an admitted request is assumed to claim.

    ``MAX_TOKENS`` reserves room for prompt + max_tokens, so an admitted request never needs to be
    preempted (vLLM's default behaviour since admit/preempt loops cut throughput ~60x).
    ``NONE`` admits on the prompt alone: more concurrency, more preemption under pressure.
    """

    MAX_TOKENS = "max_tokens"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Sizes and policies of one KV cache.

    ``num_blocks`` counts physical blocks (the null block included); set ``initial_blocks``
    lower to make the pool elastic. ``watermark`` is the fraction of capacity kept free at
    admission so running requests can grow without preemption. ``prefix_stats_window`` is how
    many recent fresh admissions the windowed prefix hit rate covers (vLLM's 1,000).

    ``sliding_window``: every layer of the model attends to at most this many positions (a
    query at ``p`` reads keys ``p - sliding_window < k <= p``), so blocks wholly before a
    request's window are released (``KVCacheManager.release_outside_window``). None for any
    model with a full-attention layer. Needs ``use_null_block``: released entries of a block
    table point at the null block.
    """

    block_size: int = 16
    num_blocks: int = 1024
    initial_blocks: int | None = None
    growth_blocks: int = 64
    use_null_block: bool = True
    enable_prefix_caching: bool = True
    hash_algo: HashAlgo = HashAlgo.XXH3_128
    model_id: str = ""
    watermark: float = 0.01
    reservation: ReservationPolicy = ReservationPolicy.MAX_TOKENS
    eviction_policy: str = "lru"
    enable_events: bool = False
    max_events: int = 10_000
    sliding_window: int | None = None
    prefix_stats_window: int = 1000

    def __post_init__(self) -> None:
        if self.prefix_stats_window <= 0:
            raise InvalidRequestError(
                f"prefix_stats_window must be positive, got {self.prefix_stats_window}"
            )
        if self.block_size <= 0:
            raise InvalidRequestError(f"block_size must be positive, got {self.block_size}")
        if self.sliding_window is not None and (
            self.sliding_window <= 0 or not self.use_null_block
        ):
            raise InvalidRequestError(
                f"sliding_window must be positive and needs use_null_block, got "
                f"{self.sliding_window} with use_null_block={self.use_null_block}"
            )
        if not 0.0 <= self.watermark < 1.0:
            raise InvalidRequestError(f"watermark must be in [0, 1), got {self.watermark}")
        try:
            object.__setattr__(self, "hash_algo", HashAlgo(self.hash_algo))
            object.__setattr__(self, "reservation", ReservationPolicy(self.reservation))
        except ValueError as exc:  # an unknown name: a typed error, like every bad value
            raise InvalidRequestError(str(exc)) from None
        self.pool_config()  # validates the pool sizes

    def pool_config(self) -> PoolConfig:
        return PoolConfig(
            num_blocks=self.num_blocks,
            initial_blocks=self.initial_blocks,
            growth_blocks=self.growth_blocks,
            use_null_block=self.use_null_block,
            eviction_policy=self.eviction_policy,
            enable_events=self.enable_events,
            max_events=self.max_events,
        )
