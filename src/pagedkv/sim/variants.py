"""``--compare KEY=V1,V2``: named settings a comparison varies, and their cross product.

Each key sets one field of the scheduler or cache config (``block_size`` also rescales
``num_blocks`` so every variant has the same usable KV memory, the null block counted apart; a
``num_blocks`` given after it wins). When the pool was sized from device memory
(``--model-config`` without ``--num-blocks``), every variant's pool is sized again from that
memory for its own block size, device and step budget, as an engine would size it.
Several ``--compare`` options combine as a cross product (``caching=on,off`` x
``num_blocks=2048,8192`` is four variants), capped at :data:`MAX_VARIANTS` so a typo cannot
start an hour-long run.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence

from pagedkv.core.config import ReservationPolicy
from pagedkv.errors import InvalidRequestError
from pagedkv.sim.allocators import Allocator
from pagedkv.sim.hardware import device_spec
from pagedkv.sim.roofline import RooflineCost
from pagedkv.sim.simulator import SimConfig
from pagedkv.sim.tiers import parse_tiers

MAX_VARIANTS = 16


def _on_off(value: str) -> bool:
    v = value.strip().lower()
    if v in ("on", "true", "yes", "1"):
        return True
    if v in ("off", "false", "no", "0"):
        return False
    raise InvalidRequestError(f"expected on or off, got {value!r}")


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise InvalidRequestError(f"expected an integer, got {value!r}") from None
    if n <= 0:
        raise InvalidRequestError(f"expected a positive integer, got {n}")
    return n


def _set_cache(cfg: SimConfig, **changes: object) -> SimConfig:
    return dataclasses.replace(cfg, cache=dataclasses.replace(cfg.cache, **changes))  # type: ignore[arg-type]


def _set_sched(cfg: SimConfig, **changes: object) -> SimConfig:
    return dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, **changes))  # type: ignore[arg-type]


def _non_negative_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise InvalidRequestError(f"expected an integer, got {value!r}") from None
    if n < 0:
        raise InvalidRequestError(f"expected an integer >= 0, got {n}")
    return n


def _set_spec(cfg: SimConfig, k: int) -> SimConfig:
    """k drafts per decode, with k lookahead slots so next step's drafts are pre-allocated."""
    return dataclasses.replace(_set_sched(cfg, num_lookahead_tokens=k), num_draft_tokens=k)


def _set_block_size(cfg: SimConfig, block_size: int) -> SimConfig:
    """The same usable KV memory with another block size.

    The null block (block 0, never allocated) is not capacity, so what is kept is
    ``(num_blocks - null) * block_size``, rounded to the nearest whole block; the null block
    is then added back. (Keeping ``num_blocks * block_size`` instead lost one large block to
    the null block: 1 of 4 usable blocks at block_size=256 over a 1,024-token pool.)
    """
    null = 1 if cfg.cache.use_null_block else 0
    usable_tokens = (cfg.cache.num_blocks - null) * cfg.cache.block_size
    usable_blocks = max(1, (usable_tokens + block_size // 2) // block_size)
    return _set_cache(cfg, block_size=block_size, num_blocks=usable_blocks + null)


def _set_allocator(cfg: SimConfig, value: str) -> SimConfig:
    """Paged blocks, or a contiguous baseline: 1-token blocks over the same usable tokens,
    admission reserving the allocator's length, no prefix sharing (pagedkv.sim.allocators)."""
    try:
        allocator = Allocator(value.strip().lower())
    except ValueError:
        known = ", ".join(a.value for a in Allocator)
        raise InvalidRequestError(f"unknown allocator {value!r}; known: {known}") from None
    cfg = dataclasses.replace(cfg, allocator=allocator)
    if not allocator.is_contiguous:
        return cfg
    cfg = _set_block_size(cfg, 1)
    return _set_cache(cfg, enable_prefix_caching=False, reservation=ReservationPolicy.MAX_TOKENS)


def _set_hardware(cfg: SimConfig, key: str, value: str) -> SimConfig:
    """Another device or tensor-parallel size for the roofline cost (and the memory pool)."""
    changes: dict[str, object]
    if key == "device":
        changes = {"device": device_spec(value)}
    else:
        changes = {"tensor_parallel_size": _positive_int(value)}
    cost = cfg.cost
    if not isinstance(cost, RooflineCost):
        raise InvalidRequestError("varies the roofline cost model: give --model-config")
    pool = cfg.memory_pool
    if pool is not None:
        pool = dataclasses.replace(pool, roofline=dataclasses.replace(pool.roofline, **changes))  # type: ignore[arg-type]
    return dataclasses.replace(cfg, cost=dataclasses.replace(cost, **changes), memory_pool=pool)  # type: ignore[arg-type]


def _resize_from_memory(cfg: SimConfig) -> SimConfig:
    """A pool sized from device memory, sized again for this variant's settings."""
    pool = cfg.memory_pool
    if pool is None:
        return cfg
    s = cfg.scheduler
    n = pool.num_blocks(cfg.cache.block_size, s.max_num_batched_tokens, s.max_num_seqs)
    return _set_cache(cfg, num_blocks=n)


def _float(value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise InvalidRequestError(f"expected a number, got {value!r}") from None


# key -> (help, apply(config, raw value) -> config)
KEYS: dict[str, tuple[str, Callable[[SimConfig, str], SimConfig]]] = {
    "caching": (
        "prefix caching on/off",
        lambda c, v: _set_cache(c, enable_prefix_caching=_on_off(v)),
    ),
    "num_blocks": (
        "KV pool size in blocks",
        lambda c, v: _set_cache(c, num_blocks=_positive_int(v)),
    ),
    "block_size": (
        "tokens per block (num_blocks rescaled: the same KV memory)",
        lambda c, v: _set_block_size(c, _positive_int(v)),
    ),
    "policy": ("fcfs or priority", lambda c, v: _set_sched(c, policy=v)),
    "reservation": (
        "max_tokens or none: admission reserves prompt+max_tokens, or the prompt only",
        lambda c, v: _set_cache(c, reservation=ReservationPolicy(v)),
    ),
    "watermark": (
        "fraction of the pool kept free at admission",
        lambda c, v: _set_cache(c, watermark=_float(v)),
    ),
    "max_batched_tokens": (
        "per-step token budget",
        lambda c, v: _set_sched(c, max_num_batched_tokens=_positive_int(v)),
    ),
    "max_num_seqs": (
        "maximum running requests",
        lambda c, v: _set_sched(c, max_num_seqs=_positive_int(v)),
    ),
    "spec_k": (
        "speculative drafts per decode step (0: off)",
        lambda c, v: _set_spec(c, _non_negative_int(v)),
    ),
    "draft_acceptance": (
        "probability that each draft is right",
        lambda c, v: dataclasses.replace(c, draft_acceptance=_float(v)),
    ),
    "device": (
        "another device for the roofline (and the memory-sized pool): H100, A100-80, L4, ...",
        lambda c, v: _set_hardware(c, "device", v),
    ),
    "tensor_parallel_size": (
        "GPUs per replica for the roofline (and the memory-sized pool)",
        lambda c, v: _set_hardware(c, "tensor_parallel_size", v),
    ),
    "replicas": (
        "engine replicas behind the router (each with the whole pool)",
        lambda c, v: dataclasses.replace(c, num_replicas=_positive_int(v)),
    ),
    "router": (
        "pagedkv router's policy over the replicas: round-robin, least-load, cache-aware",
        lambda c, v: dataclasses.replace(c, router=v.strip()),
    ),
    "allocator": (
        "paged, or a contiguous baseline reserving max/pow2/oracle length (PagedAttention paper)",
        _set_allocator,
    ),
    "tier": (
        "KV tier stack below the device pool, top first: none, host, host:128+disk, ...",
        lambda c, v: dataclasses.replace(c, tiers=parse_tiers(v)),
    ),
    "chunked_prefill": (
        "chunked prefill on/off",
        lambda c, v: _set_sched(c, enable_chunked_prefill=_on_off(v)),
    ),
}


def parse_compare(spec: str) -> tuple[str, list[str]]:
    """``"caching=on,off"`` -> ``("caching", ["on", "off"])``, the key checked."""
    key, sep, values = spec.partition("=")
    key = key.strip().replace("-", "_")
    if not sep or not values.strip():
        raise InvalidRequestError(f"--compare expects KEY=V1,V2,..., got {spec!r}")
    if key not in KEYS:
        raise InvalidRequestError(
            f"--compare: unknown key {key!r}; known: {', '.join(sorted(KEYS))}"
        )
    vals = [v.strip() for v in values.split(",") if v.strip()]
    if len(set(vals)) != len(vals):
        raise InvalidRequestError(f"--compare {key}: repeated value in {values!r}")
    return key, vals


def build_variants(base: SimConfig, specs: Sequence[str]) -> list[SimConfig]:
    """One config per combination of the ``--compare`` values, labelled ``key=value ...``.

    A bad value raises InvalidRequestError naming the key.
    """
    parsed = [parse_compare(s) for s in specs]
    keys = [k for k, _ in parsed]
    if len(set(keys)) != len(keys):
        raise InvalidRequestError(f"--compare: a key is given twice ({', '.join(keys)})")
    total = 1
    for _, vals in parsed:
        total *= len(vals)
    if total > MAX_VARIANTS:
        raise InvalidRequestError(
            f"--compare makes {total} variants; at most {MAX_VARIANTS} are allowed"
        )
    out: list[SimConfig] = []
    for combo in itertools.product(*(vals for _, vals in parsed)):
        cfg = base
        params: list[tuple[str, str]] = []
        for key, value in zip(keys, combo, strict=True):
            try:
                cfg = KEYS[key][1](cfg, value)
            except (InvalidRequestError, ValueError) as exc:
                raise InvalidRequestError(f"--compare {key}={value}: {exc}") from None
            params.append((key, value))
        if cfg.memory_pool is not None and "num_blocks" not in keys:
            try:
                cfg = _resize_from_memory(cfg)  # device memory, not blocks, is what is kept
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"--compare {' '.join(combo)}: {exc}") from None
        label = " ".join(f"{k}={v}" for k, v in params) or "default"
        out.append(dataclasses.replace(cfg, label=label, params=tuple(params)))
    return out
