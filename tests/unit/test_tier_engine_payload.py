"""A block's KV survives the trip engine -> payload -> tiers -> payload -> engine bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache  # noqa: E402
from pagedkv.tiers import (  # noqa: E402
    DiskTier,
    HostTier,
    OffloadCoordinator,
    PayloadHeader,
    TierLayout,
    decode,
    encode,
)

pytestmark = pytest.mark.engine


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_block_round_trips_through_host_and_disk(tmp_path: Path, dtype: str) -> None:
    spec = KVCacheSpec(num_layers=3, block_size=4, num_kv_heads=2, head_dim=8,
                       dtype=getattr(torch, dtype))  # fmt: skip
    kv = PagedKVCache(spec, 8)
    torch.manual_seed(0)
    for buf in (*kv.k, *kv.v):
        buf.normal_()
    layout = TierLayout("tiny", 3, 2, 8, 4, dtype)
    assert layout.block_bytes == spec.bytes_per_block
    block_hash = bytes(range(16))
    disk = DiskTier(tmp_path, layout, 1 << 20)
    off = OffloadCoordinator([HostTier(layout, 1 << 20), disk])
    off.submit(block_hash, encode(PayloadHeader(layout, block_hash, 4), kv.read_block(3)))
    assert off.flush(5)
    off.tiers[0].delete(block_hash)  # force the read from disk
    [payload] = off.fetch([block_hash])
    assert payload is not None
    kv.write_block(5, bytes(decode(payload, layout, block_hash, verify_checksum=False).body))
    for buf in (*kv.k, *kv.v):
        assert torch.equal(buf[:, 3], buf[:, 5])  # [kv_heads, blocks, block_size, head_dim]
    assert disk.stats().hits == 1
    off.close()
