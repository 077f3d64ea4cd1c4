"""Block payload encoding: round trip, and every malformation detected as CorruptBlockError."""

from __future__ import annotations

import os
import struct

import pytest

from pagedkv.errors import CorruptBlockError, InvalidRequestError
from pagedkv.tiers.payload import (
    FORMAT_VERSION,
    PayloadHeader,
    TierLayout,
    decode,
    encode,
    payload_size,
    read_header,
)

LAYOUT = TierLayout("tiny-llama", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
HASH = bytes(range(16))


def _payload(layout: TierLayout = LAYOUT, block_hash: bytes = HASH) -> tuple[bytes, bytes]:
    body = os.urandom(layout.block_bytes)
    return encode(PayloadHeader(layout, block_hash, layout.block_size), body), body


def test_round_trip_returns_the_same_body_and_header() -> None:
    data, body = _payload()
    out = decode(data, LAYOUT, HASH)
    assert bytes(out.body) == body
    assert out.header == PayloadHeader(LAYOUT, HASH, 4)
    assert len(data) == payload_size(LAYOUT)
    assert read_header(data).layout == LAYOUT


def test_block_bytes_counts_k_and_v_of_every_layer() -> None:
    assert LAYOUT.block_bytes == 2 * 2 * 4 * 2 * 8 * 2  # K,V x layers x tokens x heads x dim x fp16
    bf = TierLayout("m", 3, 1, 4, 2, "float32")
    assert bf.block_bytes == 2 * 3 * 2 * 1 * 4 * 4


def test_namespace_names_version_model_and_layout() -> None:
    assert LAYOUT.namespace == f"pkv{FORMAT_VERSION}:tiny-llama:2x2x8x4:float16"
    other = TierLayout("tiny-llama", 2, 2, 8, 4, "bfloat16")
    assert other.namespace != LAYOUT.namespace
    assert other.tag != LAYOUT.tag
    assert len(LAYOUT.tag) == 16


@pytest.mark.parametrize("flip_at", [0, 5, 9, 30, 44, 60, -1, -100])
def test_any_flipped_byte_is_detected(flip_at: int) -> None:
    data, _ = _payload()
    bad = bytearray(data)
    bad[flip_at] ^= 0x40
    with pytest.raises(CorruptBlockError):
        decode(bytes(bad), LAYOUT, HASH)


@pytest.mark.parametrize("cut", [0, 10, 52, 80, -1])
def test_truncated_payload_is_corrupt(cut: int) -> None:
    data, _ = _payload()
    with pytest.raises(CorruptBlockError):
        decode(data[:cut], LAYOUT, HASH)


def test_padded_payload_is_corrupt() -> None:
    data, _ = _payload()
    with pytest.raises(CorruptBlockError, match="truncated or padded"):
        decode(data + b"\0", LAYOUT, HASH)


def test_other_layout_or_model_is_refused() -> None:
    other = TierLayout("other-model", 2, 2, 8, 4)
    data, _ = _payload(other)
    with pytest.raises(CorruptBlockError, match="does not match"):
        decode(data, LAYOUT, HASH)


def test_other_block_hash_is_refused() -> None:
    data, _ = _payload()
    with pytest.raises(CorruptBlockError, match="names block"):
        decode(data, LAYOUT, bytes(16))


def test_future_version_is_refused() -> None:
    data, _ = _payload()
    bad = bytearray(data)
    struct.pack_into("<H", bad, 4, FORMAT_VERSION + 1)
    with pytest.raises(CorruptBlockError, match="version"):
        decode(bytes(bad), LAYOUT, HASH)


def test_checksum_can_be_skipped_for_a_verified_payload() -> None:
    data, _ = _payload()
    bad = bytearray(data)
    bad[-1] ^= 1
    out = decode(bytes(bad), LAYOUT, HASH, verify_checksum=False)
    assert out.body[-1] == data[-1] ^ 1


def test_encode_refuses_a_body_of_the_wrong_size() -> None:
    with pytest.raises(InvalidRequestError, match="must be 512 bytes"):
        encode(PayloadHeader(LAYOUT, HASH, 4), b"\0" * 511)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"head_dim": -1}, "head_dim"),
        ({"dtype": "float13"}, "unsupported dtype"),
    ],
)
def test_bad_layouts_raise(kwargs: dict[str, object], match: str) -> None:
    base: dict[str, object] = {
        "model_id": "m",
        "num_layers": 1,
        "num_kv_heads": 1,
        "head_dim": 1,
        "block_size": 1,
    }
    base.update(kwargs)
    with pytest.raises(InvalidRequestError, match=match):
        TierLayout(**base)  # type: ignore[arg-type]


def test_header_rejects_bad_token_count_and_hash() -> None:
    with pytest.raises(InvalidRequestError):
        PayloadHeader(LAYOUT, HASH, 5)
    with pytest.raises(InvalidRequestError):
        PayloadHeader(LAYOUT, b"", 4)


def test_tiers_never_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pagedkv.tiers, pagedkv.tiers.redis_tier; "
        "sys.exit(1 if 'torch' in sys.modules else 0)"
    )
    assert subprocess.run([sys.executable, "-c", code], check=False, timeout=60).returncode == 0
