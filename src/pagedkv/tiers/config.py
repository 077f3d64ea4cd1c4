"""The tiers' section of the configuration, and the stack it builds.

CLI flags map one to one: ``--host-tier-bytes`` -> ``host_bytes``, ``--disk-tier DIR`` ->
``disk_dir``, ``--disk-tier-bytes`` -> ``disk_bytes``, ``--redis URL`` -> ``redis_url``
(:func:`add_tier_arguments`, :func:`tier_config_from_args`; sizes take ``K``/``M``/``G``
suffixes, powers of 1024).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

from pagedkv.errors import InvalidRequestError
from pagedkv.tiers.base import KVTier
from pagedkv.tiers.disk import DiskTier
from pagedkv.tiers.disk_files import FsyncPolicy
from pagedkv.tiers.host import HostTier
from pagedkv.tiers.offload import OffloadCoordinator
from pagedkv.tiers.payload import TierLayout


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Which tiers to build below the device pool (all off by default)."""

    host_bytes: int = 0  # 0: no host RAM tier
    disk_dir: str | None = None
    disk_bytes: int = 0  # required (> 0) with disk_dir
    disk_fsync: str = FsyncPolicy.NONE.value
    redis_url: str | None = field(default=None, repr=False)  # may hold a password
    redis_ttl_s: int | None = None
    max_queue_blocks: int = 1024
    write_batch_blocks: int = 16

    def __post_init__(self) -> None:
        if self.host_bytes < 0:
            raise InvalidRequestError(f"host tier bytes must be >= 0, got {self.host_bytes}")
        if self.disk_dir is not None and self.disk_bytes <= 0:
            raise InvalidRequestError(
                f"--disk-tier {self.disk_dir} needs --disk-tier-bytes > 0, got {self.disk_bytes}"
            )
        if self.disk_dir is None and self.disk_bytes:
            raise InvalidRequestError("--disk-tier-bytes was given without --disk-tier DIR")
        if self.disk_fsync not in {p.value for p in FsyncPolicy}:
            names = ", ".join(p.value for p in FsyncPolicy)
            raise InvalidRequestError(f"unknown fsync policy {self.disk_fsync!r}; use {names}")
        if self.redis_ttl_s is not None and self.redis_ttl_s <= 0:
            raise InvalidRequestError(f"redis TTL must be positive, got {self.redis_ttl_s}")
        if self.max_queue_blocks <= 0 or self.write_batch_blocks <= 0:
            raise InvalidRequestError("max_queue_blocks and write_batch_blocks must be positive")

    @property
    def is_enabled(self) -> bool:
        return bool(self.host_bytes or self.disk_dir or self.redis_url)


def build_offload(config: TierConfig, layout: TierLayout) -> OffloadCoordinator | None:
    """The tier stack (host -> disk -> Redis) behind one coordinator; None when no tier is set."""
    if not config.is_enabled:
        return None
    tiers: list[KVTier] = []
    try:
        if config.host_bytes:
            tiers.append(HostTier(layout, config.host_bytes))
        if config.disk_dir is not None:
            tiers.append(
                DiskTier(config.disk_dir, layout, config.disk_bytes, fsync=config.disk_fsync)
            )
        if config.redis_url is not None:
            from pagedkv.tiers.redis_tier import RedisTier  # needs the optional redis package

            tiers.append(RedisTier(config.redis_url, layout, ttl_s=config.redis_ttl_s))
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    return OffloadCoordinator(
        tiers,
        max_queue_blocks=config.max_queue_blocks,
        write_batch_blocks=config.write_batch_blocks,
    )


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"1048576"``, ``"512M"``, ``"2GiB"``, ``"1.5g"`` -> bytes (suffixes are powers of 1024)."""
    m = _SIZE.match(text)
    if m is None:
        raise InvalidRequestError(f"not a byte size: {text!r} (use e.g. 1073741824, 512M, 2G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _size_arg(text: str) -> int:
    try:
        return parse_bytes(text)
    except InvalidRequestError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """The KV tier flags shared by ``pagedkv generate``, ``demo`` and ``serve``."""
    g = parser.add_argument_group("KV tiers (below the device pool; all off by default)")
    g.add_argument("--host-tier-bytes", type=_size_arg, default=0, help="host RAM tier budget")
    g.add_argument("--disk-tier", metavar="DIR", default=None, help="persistent disk tier folder")
    g.add_argument("--disk-tier-bytes", type=_size_arg, default=0, help="disk tier budget")
    g.add_argument(
        "--disk-tier-fsync",
        default=FsyncPolicy.NONE.value,
        choices=[p.value for p in FsyncPolicy],
        help="fsync policy of disk tier writes",
    )
    g.add_argument("--redis", metavar="URL", default=None, help="shared Redis/Valkey tier")
    g.add_argument("--redis-ttl", type=int, default=None, help="seconds a Redis block lives")


def tier_config_from_args(args: argparse.Namespace) -> TierConfig | None:
    """The :class:`TierConfig` the flags of :func:`add_tier_arguments` describe (None: no tier).
    Raises InvalidRequestError for an inconsistent set (a disk folder without a budget)."""
    cfg = TierConfig(
        host_bytes=args.host_tier_bytes,
        disk_dir=args.disk_tier,
        disk_bytes=args.disk_tier_bytes,
        disk_fsync=args.disk_tier_fsync,
        redis_url=args.redis,
        redis_ttl_s=args.redis_ttl,
    )
    return cfg if cfg.is_enabled else None
