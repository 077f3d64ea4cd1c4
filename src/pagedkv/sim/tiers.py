"""KV tiers below the device pool on the virtual clock (``--tier NAME[:GiB[:GB/s[:µs]]]``).

A :class:`TierSpec` is a capacity, a read bandwidth and a per-load latency; a stack of them is
ordered top first (host RAM, then local disk, then Redis, as the engine's stack). The stack
plays the part the engine's :class:`~pagedkv.tiers.offload.OffloadCoordinator` plays for the
real scheduler: it is the scheduler's ``TierIndex``, so the scheduler's own load path (a waiting
request whose prefix continues in a tier is admitted LOADING, its blocks filled this step,
committed at ``update``) runs unchanged. What the simulator adds is the time and the bytes:

* **stores** (write-through, as the engine's ``TierIO.blocks_to_store``): after each step every
  full block the step finished computing is written to every tier; writes are asynchronous in
  the engine and cost no step time here. Each tier keeps blocks LRU by capacity
  (``capacity_bytes // bytes per block``), so a block evicted from the device pool is found in a
  tier for as long as that tier's capacity holds it;
* **loads**: a step that loads ``n`` blocks of one request from a tier takes
  ``latency + n x block bytes / bandwidth`` more (the engine loads synchronously before the
  forward pass; several requests' loads run one after another). A block loaded from a lower
  tier is promoted into the tiers above it, as the coordinator does;
* **slower than recompute**: the coordinator skips a tier whose measured load time per block
  is above the measured recompute cost per block. The simulator knows both exactly, so it makes
  the decision the engine's estimates converge to, per run of blocks: a tier whose load of the
  run would take at least as long as prefilling those tokens (the step-cost model's marginal
  cost, :meth:`SimTierStack.recompute_s`) is skipped, and the next tier down is asked.

Bytes per block are ``block_size x`` the KV bytes of one token: the roofline's per-GPU figure
with ``--model-config`` (each tensor-parallel rank loads its own shard over its own link),
otherwise Llama-3-8B bf16 (128 KiB per token), the constant cost model's basis.

Presets (:data:`TIER_PRESETS`; each field can be overridden in the flag):

========  ==========  =========  ========  ===============================================
name      capacity    GB/s       latency   basis
========  ==========  =========  ========  ===============================================
host      64 GiB      25         10 µs     pinned host RAM over PCIe 5.0 x16 (64 GB/s raw,
                                           ~25 GB/s measured for scattered KV blocks)
disk      1,000 GiB   5          100 µs    one local NVMe PCIe 4.0 SSD (~7 GB/s sequential)
redis     256 GiB     1.25       500 µs    Redis/Valkey over 10 GbE (one round trip + copy)
========  ==========  =========  ========  ===============================================

``cpu`` is accepted for ``host`` (vLLM's and LMCache's name for the same tier).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.errors import InvalidRequestError, InvariantViolation
from pagedkv.sched.output import SchedulerOutput
from pagedkv.sim.cost_model import StepCost
from pagedkv.sim.roofline import RooflineCost

GB = 10**9
GiB = 2**30
DEFAULT_KV_BYTES_PER_TOKEN = 2 * 32 * 8 * 128 * 2  # Llama-3-8B bf16: 128 KiB per token


def kv_bytes_per_token_of(cost: StepCost, given: int | None = None) -> int:
    """One token's K and V as a tier moves them: ``given``, else the roofline's per-GPU figure,
    else :data:`DEFAULT_KV_BYTES_PER_TOKEN` (the constant cost model's Llama-3-8B)."""
    if given is not None:
        return given
    if isinstance(cost, RooflineCost):
        return cost.kv_bytes_per_token_per_gpu
    return DEFAULT_KV_BYTES_PER_TOKEN


@dataclass(frozen=True, slots=True)
class TierSpec:
    """One tier: ``capacity_bytes`` held, read at ``bytes_per_s`` after ``latency_s`` per load.

    Invariants: capacity >= 0, bandwidth > 0 and finite, latency >= 0 and finite.
    """

    name: str
    capacity_bytes: int
    bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise InvalidRequestError(
                f"tier {self.name}: capacity must be >= 0 bytes, got {self.capacity_bytes}"
            )
        if not (math.isfinite(self.bytes_per_s) and self.bytes_per_s > 0):
            raise InvalidRequestError(
                f"tier {self.name}: bandwidth must be a positive number, got {self.bytes_per_s}"
            )
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            raise InvalidRequestError(
                f"tier {self.name}: latency must be a number >= 0, got {self.latency_s}"
            )

    def load_s(self, num_blocks: int, block_bytes: int) -> float:
        """Seconds to load ``num_blocks`` blocks of ``block_bytes`` in one request."""
        return self.latency_s + num_blocks * block_bytes / self.bytes_per_s

    def describe(self) -> str:
        """``host:64:25:10``: the flag that rebuilds this spec."""
        return (
            f"{self.name}:{self.capacity_bytes / GiB:g}:{self.bytes_per_s / GB:g}:"
            f"{self.latency_s * 1e6:g}"
        )


TIER_PRESETS: dict[str, TierSpec] = {
    "host": TierSpec("host", 64 * GiB, 25 * GB, 10e-6),
    "disk": TierSpec("disk", 1000 * GiB, 5 * GB, 100e-6),
    "redis": TierSpec("redis", 256 * GiB, 1.25 * GB, 500e-6),
}
_ALIASES = {"cpu": "host"}


def _number(text: str, what: str, spec: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise InvalidRequestError(f"tier {spec!r}: {what} must be a number, got {text!r}") from None
    if not math.isfinite(v):
        raise InvalidRequestError(f"tier {spec!r}: {what} must be finite, got {text!r}")
    return v


def parse_tier(spec: str) -> TierSpec:
    """``NAME[:GiB[:GB/s[:latency µs]]]`` -> a spec; omitted (or empty) fields keep the preset's.

    ``host``, ``disk``, ``redis`` (and ``cpu`` for ``host``) are the presets; another name needs
    all three numbers. Raises InvalidRequestError naming the bad part.
    """
    parts = [p.strip() for p in spec.strip().split(":")]
    name = _ALIASES.get(parts[0].lower(), parts[0].lower())
    if not name or len(parts) > 4:
        raise InvalidRequestError(
            f"--tier expects NAME[:CAPACITY_GiB[:GBps[:LATENCY_us]]], got {spec!r}"
        )
    base = TIER_PRESETS.get(name)
    fields = parts[1:] + [""] * (4 - len(parts))
    if base is None and not all(fields):
        raise InvalidRequestError(
            f"tier {name!r} is not a preset ({', '.join(TIER_PRESETS)}, or cpu): give all of "
            f"NAME:CAPACITY_GiB:GBps:LATENCY_us, got {spec!r}"
        )
    cap = base.capacity_bytes if base else 0
    bw = base.bytes_per_s if base else 1.0
    lat = base.latency_s if base else 0.0
    if fields[0]:
        cap = round(_number(fields[0], "capacity (GiB)", spec) * GiB)
    if fields[1]:
        bw = _number(fields[1], "bandwidth (GB/s)", spec) * GB
    if fields[2]:
        lat = _number(fields[2], "latency (µs)", spec) / 1e6
    return TierSpec(name, cap, bw, lat)


def parse_tiers(spec: str) -> tuple[TierSpec, ...]:
    """``none`` or ``host:64+disk`` (top tier first, ``+`` between tiers) -> specs.

    The ``--compare tier=`` spelling; tier names must be distinct."""
    text = spec.strip()
    if text.lower() in ("none", "off", ""):
        return ()
    tiers = tuple(parse_tier(p) for p in text.split("+"))
    names = [t.name for t in tiers]
    if len(set(names)) != len(names):
        raise InvalidRequestError(f"tier stack {spec!r} names a tier twice")
    return tiers


@dataclass(slots=True)
class TierCounters:
    """One tier's counters over a run (a hot mutable record)."""

    num_stored_blocks: int = 0  # new blocks written (a block already held is only refreshed)
    num_evicted_blocks: int = 0  # dropped for capacity, LRU first
    num_hit_blocks: int = 0  # loaded from this tier into the device pool
    num_skipped_blocks: int = 0  # held here but not loaded: slower than recompute
    load_s: float = 0.0  # simulated seconds spent loading from this tier


@dataclass(frozen=True, slots=True)
class TierReport:
    """What one tier did in a run; ``hit_rate`` = hit blocks / cacheable blocks queried."""

    name: str
    spec: str  # NAME:GiB:GB/s:µs
    capacity_blocks: int
    num_stored_blocks: int
    num_evicted_blocks: int
    num_hit_blocks: int
    num_skipped_blocks: int
    load_s: float
    hit_rate: float


class _Tier:
    """One tier's blocks, LRU by capacity: an ordered dict of hashes, oldest first.

    Invariant: ``len(blocks) <= capacity_blocks``. Complexity: store, touch, lookup O(1).
    """

    __slots__ = ("blocks", "capacity_blocks", "counters", "spec")

    def __init__(self, spec: TierSpec, block_bytes: int) -> None:
        self.spec = spec
        self.capacity_blocks = spec.capacity_bytes // block_bytes
        self.blocks: OrderedDict[bytes, None] = OrderedDict()
        self.counters = TierCounters()

    def store(self, block_hash: bytes) -> None:
        blocks = self.blocks
        if block_hash in blocks:
            blocks.move_to_end(block_hash)
            return
        if self.capacity_blocks <= 0:
            return
        blocks[block_hash] = None
        self.counters.num_stored_blocks += 1
        if len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
            self.counters.num_evicted_blocks += 1

    def run_length(self, hashes: Sequence[bytes], start: int) -> int:
        n, blocks = start, self.blocks
        while n < len(hashes) and hashes[n] in blocks:
            n += 1
        return n - start


class SimTierStack:
    """The tiers of one simulated engine: the scheduler's ``TierIndex`` and the loads' clock.

    ``contains_prefix`` is read-only (the scheduler may ask and then fail to allocate);
    ``load_time_s`` is called once per step with the step's ``block_loads`` and applies the
    loads (counters, promotion); ``store_step`` writes the blocks the step computed.
    """

    def __init__(
        self,
        specs: Sequence[TierSpec],
        block_size: int,
        kv_bytes_per_token: int,
        cost: StepCost,
    ) -> None:
        if kv_bytes_per_token <= 0:
            raise InvalidRequestError(f"kv_bytes_per_token must be positive: {kv_bytes_per_token}")
        self.block_size = block_size
        self.block_bytes = block_size * kv_bytes_per_token
        self.tiers = [_Tier(s, self.block_bytes) for s in specs]
        self.cost = cost
        self._recompute: dict[int, float] = {}  # num blocks -> seconds (memo)

    # ---------------------------------------------------------------- decisions
    def recompute_s(self, num_blocks: int) -> float:
        """The step-cost model's marginal cost of prefilling ``num_blocks`` blocks: a prefill of
        ``T = num_blocks x block_size`` tokens less a one-token step (the per-step cost apart)."""
        got = self._recompute.get(num_blocks)
        if got is None:
            t = num_blocks * self.block_size
            full = self.cost.step_time(t, 0, t, t * (t + 1) // 2)
            got = max(0.0, full - self.cost.step_time(1, 0, 1, 1))
            self._recompute[num_blocks] = got
        return got

    def _plan(self, hashes: Sequence[bytes]) -> list[tuple[int, int, int]]:
        """``(tier index, start, count)`` runs that would be loaded, top tier first at each
        point; a tier whose run loads slower than recomputing it is passed over."""
        plan: list[tuple[int, int, int]] = []
        i = 0
        while i < len(hashes):
            for k, tier in enumerate(self.tiers):
                n = tier.run_length(hashes, i)
                if n and tier.spec.load_s(n, self.block_bytes) < self.recompute_s(n):
                    plan.append((k, i, n))
                    i += n
                    break
            else:
                break
        return plan

    def contains_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """Blocks, from the first, worth loading from the stack (the scheduler's TierIndex)."""
        if not self.tiers:
            return 0
        return sum(n for _, _, n in self._plan(block_hashes))

    # ---------------------------------------------------------------- the step
    def load_time_s(self, out: SchedulerOutput, owner_of: dict[int, str]) -> float:
        """Apply the loads of ``out`` (grouped per request by ``owner_of[block_id]``) and
        return their simulated seconds; blocks are promoted into the tiers above."""
        per_request: dict[str, list[bytes]] = {}
        for block_id, block_hash in out.block_loads:
            per_request.setdefault(owner_of[block_id], []).append(block_hash)
        total = 0.0
        for hashes in per_request.values():
            for k, start, n in self._plan(hashes):
                tier = self.tiers[k]
                dt = tier.spec.load_s(n, self.block_bytes)
                tier.counters.num_hit_blocks += n
                tier.counters.load_s += dt
                total += dt
                for h in hashes[start : start + n]:
                    for upper in self.tiers[: k + 1]:  # promote, and refresh the source's LRU
                        upper.store(h)
        return total

    def note_skips(self, hashes: Sequence[bytes], num_loaded: int) -> None:
        """Count blocks past the loaded run that a tier holds but loads slower than recompute."""
        for tier in self.tiers:
            n = tier.run_length(hashes, num_loaded)
            if n:
                tier.counters.num_skipped_blocks += n
                return

    def store(self, block_hashes: Sequence[bytes]) -> None:
        """Write-through: every tier gets (or refreshes) each block."""
        for tier in self.tiers:
            for h in block_hashes:
                tier.store(h)

    def check_invariants(self) -> None:
        """T1: no tier holds more blocks than its capacity."""
        for t in self.tiers:
            if len(t.blocks) > max(0, t.capacity_blocks):
                raise InvariantViolation(
                    f"T1: tier {t.spec.name} holds {len(t.blocks)} blocks > {t.capacity_blocks}"
                )


def tier_reports(stacks: Sequence[SimTierStack], num_query_blocks: int) -> tuple[TierReport, ...]:
    """Each tier's report, summed over the replicas' stacks (all built from the same specs);
    ``hit_rate`` over ``num_query_blocks``, the cacheable blocks every replica was asked for."""
    if not stacks:
        return ()
    out = []
    for tiers in zip(*(s.tiers for s in stacks), strict=True):
        spec = tiers[0].spec
        hits = sum(t.counters.num_hit_blocks for t in tiers)
        out.append(
            TierReport(
                name=spec.name,
                spec=spec.describe(),
                capacity_blocks=sum(t.capacity_blocks for t in tiers),
                num_stored_blocks=sum(t.counters.num_stored_blocks for t in tiers),
                num_evicted_blocks=sum(t.counters.num_evicted_blocks for t in tiers),
                num_hit_blocks=hits,
                num_skipped_blocks=sum(t.counters.num_skipped_blocks for t in tiers),
                load_s=sum(t.counters.load_s for t in tiers),
                hit_rate=hits / num_query_blocks if num_query_blocks else 0.0,
            )
        )
    return tuple(out)
