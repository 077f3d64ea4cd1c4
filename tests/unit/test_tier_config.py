"""TierConfig validation and the stack build_offload makes from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.errors import InvalidRequestError, TierUnavailableError
from pagedkv.tiers import DiskTier, HostTier, TierConfig, TierLayout, build_offload

LAYOUT = TierLayout("m", 1, 1, 8, 4)


def test_nothing_configured_builds_nothing() -> None:
    assert not TierConfig().is_enabled
    assert build_offload(TierConfig(), LAYOUT) is None


def test_host_and_disk_build_in_order(tmp_path: Path) -> None:
    cfg = TierConfig(host_bytes=1 << 20, disk_dir=str(tmp_path / "kv"), disk_bytes=1 << 22)
    off = build_offload(cfg, LAYOUT)
    assert off is not None
    assert [type(t) for t in off.tiers] == [HostTier, DiskTier]
    assert [t.name for t in off.tiers] == ["host", "disk"]
    off.close()


def test_a_locked_disk_folder_fails_the_build_with_a_typed_error(tmp_path: Path) -> None:
    cfg = TierConfig(host_bytes=1 << 20, disk_dir=str(tmp_path), disk_bytes=1 << 22)
    held = DiskTier(tmp_path, LAYOUT, 1 << 22)  # holds the folder lock
    with pytest.raises(TierUnavailableError):
        build_offload(cfg, LAYOUT)
    held.close()
    off = build_offload(cfg, LAYOUT)
    assert off is not None
    off.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"host_bytes": -1}, "host tier"),
        ({"disk_dir": "/x"}, "disk-tier-bytes"),
        ({"disk_bytes": 5}, "without --disk-tier"),
        ({"disk_dir": "/x", "disk_bytes": 5, "disk_fsync": "always"}, "fsync"),
        ({"redis_url": "redis://h", "redis_ttl_s": 0}, "TTL"),
        ({"max_queue_blocks": 0}, "max_queue_blocks"),
    ],
)
def test_bad_config_raises(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        TierConfig(**kwargs)  # type: ignore[arg-type]
