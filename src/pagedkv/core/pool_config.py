"""The sizes and options of a block pool (``PoolConfig``); ``CacheConfig.pool_config()`` builds
one from the cache's section of the config."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.core.eviction import make_policy
from pagedkv.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Sizes of a block pool. Counts are physical blocks, the null block included.

    ``initial_blocks`` < ``num_blocks`` makes the pool elastic: it starts small and grows by
    ``growth_blocks`` at a time (at least what one allocation needs) up to ``num_blocks``.
    """

    num_blocks: int
    initial_blocks: int | None = None
    growth_blocks: int = 64
    use_null_block: bool = True
    eviction_policy: str = "lru"
    enable_events: bool = False
    max_events: int = 10_000

    def __post_init__(self) -> None:
        reserved = 1 if self.use_null_block else 0
        if self.num_blocks <= reserved:
            raise InvalidRequestError(
                f"num_blocks must exceed {reserved} (the null block), got {self.num_blocks}"
            )
        initial = self.initial_num_blocks
        if not reserved < initial <= self.num_blocks:
            raise InvalidRequestError(
                f"initial_blocks must be in ({reserved}, {self.num_blocks}], got {initial}"
            )
        if self.growth_blocks <= 0:
            raise InvalidRequestError(f"growth_blocks must be positive, got {self.growth_blocks}")
        if self.max_events <= 0:
            raise InvalidRequestError(f"max_events must be positive, got {self.max_events}")
        make_policy(self.eviction_policy)  # raises InvalidRequestError for an unknown name

    @property
    def initial_num_blocks(self) -> int:
        return self.num_blocks if self.initial_blocks is None else self.initial_blocks
