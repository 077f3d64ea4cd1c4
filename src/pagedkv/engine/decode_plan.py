"""How a step's single-token decodes are cut into groups of similar context length.

Torch's batched decode path pads each group's K/V to its longest context; one more group costs
one more gather and SDPA call per layer. ``plan_decode_groups`` picks the cheapest cut.
"""

from __future__ import annotations

import functools
import itertools

import numpy as np

# One more decode group (two gathers and an SDPA call per layer) costs about as much as
# attending over this many more padded K/V elements per buffer. Measured on CPU: ~40 us per
# extra call against ~5 us per padded block of 4,096 elements (16 x 4 heads x 64).
_GROUP_COST_ELEMS = 32 * 1024
_MAX_DECODE_GROUPS = 4
_EXACT_PLAN_MAX = 128  # above this many decodes, cut equal-count runs instead of the DP


def plan_decode_groups(
    context_lens: np.ndarray, block_size: int, cache_row_elems: int
) -> list[np.ndarray]:
    """Split decodes (their context lengths) into at most ``_MAX_DECODE_GROUPS`` groups of
    similar length. Sorted by length, the decodes are cut into runs minimising the padded
    blocks (rows x the run's longest) plus a per-group cost: exactly, by dynamic programming
    over the cut points (vectorised, O(G x D^2) elementwise), for up to ``_EXACT_PLAN_MAX``
    decodes; above that the best of 1..G equal-count runs. One long context among short ones
    gets a group of its own instead of padding its neighbours. Returns each group's member
    indices (every decode exactly once, groups in increasing length).

    The cut points depend only on the sorted block counts, which change when a decode crosses
    a block boundary or the batch changes, so they are memoised (most steps reuse them)."""
    blocks = -(-np.asarray(context_lens, dtype=np.int64) // block_size)
    order = np.argsort(blocks, kind="stable")
    if len(order) <= 1:
        return [order]
    penalty = max(1.0, _GROUP_COST_ELEMS / cache_row_elems)
    cuts = _plan_cuts(tuple(blocks[order].tolist()), penalty)
    return [order[a:z] for a, z in itertools.pairwise(cuts)]


@functools.lru_cache(maxsize=256)
def _plan_cuts(sorted_blocks: tuple[int, ...], penalty: float) -> tuple[int, ...]:
    """Cut points ``0 = c0 < c1 < ... = n`` of the cheapest plan (see plan_decode_groups)."""
    b = np.array(sorted_blocks, dtype=np.float64)
    n = len(b)
    if n > _EXACT_PLAN_MAX:
        return _equal_count_cuts(b, penalty)
    i = np.arange(n)
    # run[a, j]: padded blocks of the run a..j (its longest is the last, b[j]); inf if a > j
    run = np.where(i[:, None] <= i[None, :], (i[None, :] - i[:, None] + 1) * b[None, :], np.inf)
    best = run[0] + penalty  # best[j]: decodes 0..j in one group
    starts: list[np.ndarray] = []  # per extra group: where the last run starts, for each j
    costs = [best[-1]]
    for _ in range(1, min(_MAX_DECODE_GROUPS, n)):
        cand = best[:-1, None] + run[1:, :] + penalty  # last run starts at a = row + 1
        start = cand.argmin(axis=0) + 1
        best = np.concatenate(([np.inf], cand.min(axis=0)[1:]))
        starts.append(start)
        costs.append(best[-1])
    groups = int(np.argmin(costs)) + 1
    cuts = [n]
    for g in range(groups - 1, 0, -1):  # walk back from the last run
        cuts.append(int(starts[g - 1][cuts[-1] - 1]))
    cuts.append(0)
    return tuple(reversed(cuts))


def _equal_count_cuts(b: np.ndarray, penalty: float) -> tuple[int, ...]:
    n = len(b)
    best: tuple[int, ...] = (0, n)
    best_cost = n * b[-1] + penalty
    for groups in range(2, min(_MAX_DECODE_GROUPS, n) + 1):
        cuts = tuple((n * g) // groups for g in range(groups + 1))
        cost = penalty * groups + sum((z - a) * b[z - 1] for a, z in itertools.pairwise(cuts))
        if cost < best_cost:
            best_cost, best = cost, cuts
    return best
