"""The block pool's invariants (I1..I7 of ``BlockPool``), recomputed from scratch.

A friend of ``block_pool.py``: it reads the pool's private fields so the pool itself stays
about its operations. ``BlockPool.check_invariants`` calls ``check_pool``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.errors import InvariantViolation

if TYPE_CHECKING:
    from pagedkv.core.block_pool import BlockPool


def check_pool(pool: BlockPool) -> None:
    """Verify I1..I7 of ``pool`` from scratch; raise InvariantViolation naming the broken one."""
    n = len(pool._ref)
    if n > pool.config.num_blocks:
        raise InvariantViolation(
            f"I5: {n} materialized blocks > num_blocks {pool.config.num_blocks}"
        )
    stack = set(pool._free_uncached)
    if len(stack) != len(pool._free_uncached):
        raise InvariantViolation("I1: a block appears twice in the uncached stack")
    policy = set(pool._policy)
    if len(policy) != len(pool._policy) or stack & policy:
        raise InvariantViolation("I1: a block is in the free stack and the policy at once")
    shared = 0
    for b in range(n):
        r, h = pool._ref[b], pool._hash[b]
        if r < 0:
            raise InvariantViolation(f"I1: block {b} has ref count {r}")
        if b < pool._reserved:
            if r != 0 or h is not None or b in stack or b in policy:
                raise InvariantViolation("I4: the null block was used, hashed or freed")
            continue
        if r > 1:
            shared += 1
        in_stack, in_policy = b in stack, b in policy
        if r > 0 and (in_stack or in_policy):
            raise InvariantViolation(f"I1: block {b} has ref {r} but is on a free list")
        if r == 0 and not (in_stack or in_policy):
            raise InvariantViolation(f"I1: block {b} has ref 0 but is on no free list")
        is_copy = b in pool._copy_of
        if in_stack and (h is not None or is_copy):
            raise InvariantViolation(f"I1: block {b} is on the uncached stack with content")
        if in_policy and h is None and not is_copy:
            raise InvariantViolation(f"I1: block {b} is in the eviction policy without content")
        if h is not None and pool._index.get(h) != b:
            raise InvariantViolation(f"I2: block {b} has a hash the index maps elsewhere")
    for h, b in pool._index.items():
        if not 0 <= b < n or pool._hash[b] != h:
            raise InvariantViolation(f"I2: index maps a hash to block {b}, which holds another")
    flags = bytearray(
        1 if h is not None else 2 if b in pool._copy_of else 0 for b, h in enumerate(pool._hash)
    )
    if pool._hashed != flags:
        raise InvariantViolation("I2: the hashed flags disagree with the block hashes and copies")
    if shared != pool._num_shared:
        raise InvariantViolation(f"I3: num_shared_blocks is {pool._num_shared}, counted {shared}")
    free = len(stack) + len(policy) + pool.config.num_blocks - n
    used = (pool.capacity_blocks - free) / pool.capacity_blocks
    if free != pool.num_free_blocks or used != pool.usage:
        raise InvariantViolation(
            f"I6: num_free_blocks/usage are {pool.num_free_blocks}/{pool.usage}, counted "
            f"{free}/{used}"
        )
    _check_copies(pool)


def _check_copies(pool: BlockPool) -> None:
    listed = [(b, h) for h, b in pool._copies.items()]
    listed += [(b, h) for h, bs in pool._more_copies.items() for b in bs]
    if (
        sorted(listed) != sorted(pool._copy_of.items())
        or not all(pool._more_copies.values())
        or not pool._more_copies.keys() <= pool._copies.keys()
    ):
        raise InvariantViolation("I7: the copy lists and the copy map disagree")
    policy = set(pool._policy)
    for b, h in pool._copy_of.items():
        alive = pool._ref[b] > 0 or b in policy
        if not alive or pool._hash[b] is not None or pool._index.get(h, b) == b:
            raise InvariantViolation(
                f"I7: copy block {b} must be in use or cached-free, unhashed, its hash indexed "
                "elsewhere"
            )
    num_free_copies = len(policy & pool._copy_of.keys())
    if num_free_copies != pool._num_free_copies:
        raise InvariantViolation(
            f"I7: {pool._num_free_copies} freed copies counted, {num_free_copies} in the policy"
        )
    front = list(pool._policy)[:num_free_copies]
    if any(b not in pool._copy_of for b in front):
        raise InvariantViolation("I7: a freed copy is behind a hashed block in the policy")
