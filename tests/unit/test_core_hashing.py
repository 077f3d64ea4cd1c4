"""Chained block hashes: determinism, algorithms, extra keys, incremental extension, encodings."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.core import (
    BlockHashChain,
    HashAlgo,
    HashContext,
    MultiModalItem,
    RangeKey,
    hash_blocks,
)
from pagedkv.core.hashing import encode_key, hash_function
from pagedkv.errors import InvalidRequestError

TOKENS = list(range(1000, 1020))  # five full blocks of 4
CTX = HashContext(
    model_id="tiny-llama",
    cache_salt="tenant-7",
    adapter_id="lora-a",
    mm_items=(MultiModalItem(b"\x01img", offset=5, length=6),),
    range_keys=(RangeKey(12, 16, ("turn", 2)),),
)

_SUBPROCESS_SCRIPT = """
import json
from pagedkv.core import HashAlgo, HashContext, MultiModalItem, RangeKey, hash_blocks
ctx = HashContext(model_id="tiny-llama", cache_salt="tenant-7", adapter_id="lora-a",
                  mm_items=(MultiModalItem(b"\\x01img", offset=5, length=6),),
                  range_keys=(RangeKey(12, 16, ("turn", 2)),), algo=HashAlgo(ALGO))
print(json.dumps([h.hex() for h in hash_blocks(list(range(1000, 1020)), 4, ctx)]))
"""


@pytest.mark.parametrize("algo", list(HashAlgo))
def test_hashes_are_identical_in_another_process(algo: HashAlgo) -> None:
    ctx = HashContext(
        model_id=CTX.model_id,
        cache_salt=CTX.cache_salt,
        adapter_id=CTX.adapter_id,
        mm_items=CTX.mm_items,
        range_keys=CTX.range_keys,
        algo=algo,
    )
    here = [h.hex() for h in hash_blocks(TOKENS, 4, ctx)]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a different str hash seed than ours
    out = subprocess.run(
        [sys.executable, "-c", _SUBPROCESS_SCRIPT.replace("ALGO", repr(algo.value))],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    assert json.loads(out.stdout) == here


def test_block_hash_encoding_matches_the_documented_bytes() -> None:
    # Hashes name blocks on disk and in Redis: the encoding is spelled out here byte by byte, so
    # a changed encoding has to be a deliberate version bump, not an accident.
    def key_str(s: str) -> bytes:
        return b"s" + struct.pack("<I", len(s)) + s.encode()

    for algo, fn in (
        (HashAlgo.SHA256, lambda b: hashlib.sha256(b).digest()),
        (HashAlgo.XXH3_128, xxhash.xxh3_128_digest),
    ):
        seed = b"pagedkv/block-hash/v1"
        seed += b"t" + struct.pack("<I", 2) + key_str(algo.value) + key_str("m")
        seed += b"b" + struct.pack("<I", 0)  # no salt
        root = fn(seed)
        h0 = fn(root + struct.pack("<4I", 1, 2, 3, 4))
        h1 = fn(h0 + struct.pack("<4I", 2**32 - 1, 0, 7, 8))
        tokens = [1, 2, 3, 4, 2**32 - 1, 0, 7, 8]
        assert hash_blocks(tokens, 4, HashContext(model_id="m", algo=algo)) == [h0, h1]
    got = hash_blocks([1, 2, 3, 4], 4, HashContext(model_id="m"))[0].hex()
    assert got == "4ff22262d221c6549250f19d03a2a7b3"


def test_xxh3_and_sha256_differ_in_width_and_value() -> None:
    x = hash_blocks(TOKENS, 4, HashContext(algo=HashAlgo.XXH3_128))
    s = hash_blocks(TOKENS, 4, HashContext(algo=HashAlgo.SHA256))
    assert [len(h) for h in x] == [16] * 5
    assert [len(h) for h in s] == [32] * 5
    assert not {h[:16] for h in s} & set(x)


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_blocks(list(range(7)), 4)) == 1
    assert hash_blocks([1, 2, 3], 4) == []


def test_chain_hash_names_the_whole_prefix() -> None:
    a = hash_blocks([1, 1, 1, 1, 2, 2, 2, 2], 4)
    b = hash_blocks([9, 9, 9, 9, 2, 2, 2, 2], 4)
    assert a[1] != b[1]  # same tokens in block 1, different parent


def test_root_mixes_model_salt_and_algorithm() -> None:
    roots = {
        HashContext().root_hash(),
        HashContext(model_id="a").root_hash(),
        HashContext(cache_salt="").root_hash(),  # an empty salt is not "no salt"
        HashContext(cache_salt="a").root_hash(),
        HashContext(model_id="a", cache_salt="a").root_hash(),
    }
    assert len(roots) == 5


def _first_changed(a: list[bytes], b: list[bytes]) -> int:
    assert len(a) == len(b)
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def _overlapped(ctx: HashContext, num_blocks: int, bs: int = 4) -> list[int]:
    return [i for i in range(num_blocks) if ctx.block_extra_keys(i * bs, (i + 1) * bs)]


def test_adapter_changes_every_block() -> None:
    plain = hash_blocks(TOKENS, 4)
    lora = hash_blocks(TOKENS, 4, HashContext(adapter_id="a"))
    other = hash_blocks(TOKENS, 4, HashContext(adapter_id="b"))
    assert all(x != y != z for x, y, z in zip(plain, lora, other, strict=True))


def test_multimodal_item_changes_exactly_the_blocks_it_overlaps() -> None:
    img_a = HashContext(mm_items=(MultiModalItem("img-a", offset=5, length=6),))  # blocks 1, 2
    img_b = HashContext(mm_items=(MultiModalItem("img-b", offset=5, length=6),))
    assert _overlapped(img_a, 5) == [1, 2]
    plain = hash_blocks(TOKENS, 4)
    a, b = hash_blocks(TOKENS, 4, img_a), hash_blocks(TOKENS, 4, img_b)
    assert _first_changed(plain, a) == 1
    assert _first_changed(a, b) == 1
    assert all(x != y for x, y in zip(a[1:], b[1:], strict=True))  # the chain carries it on


def test_multimodal_item_offset_matters() -> None:
    at5 = HashContext(mm_items=(MultiModalItem("img", offset=5, length=2),))
    at6 = HashContext(mm_items=(MultiModalItem("img", offset=6, length=2),))
    assert _overlapped(at5, 5) == _overlapped(at6, 5) == [1]
    assert _first_changed(hash_blocks(TOKENS, 4, at5), hash_blocks(TOKENS, 4, at6)) == 1


def test_multimodal_item_ending_at_block_boundary_does_not_touch_next_block() -> None:
    ctx = HashContext(mm_items=(MultiModalItem("img", offset=4, length=4),))
    assert _overlapped(ctx, 5) == [1]


def test_range_key_changes_exactly_the_blocks_it_overlaps() -> None:
    t1 = HashContext(range_keys=(RangeKey(8, 13, "turn-1"),))  # blocks 2, 3
    t2 = HashContext(range_keys=(RangeKey(8, 13, "turn-2"),))
    assert _overlapped(t1, 5) == [2, 3]
    assert _first_changed(hash_blocks(TOKENS, 4), hash_blocks(TOKENS, 4, t1)) == 2
    assert _first_changed(hash_blocks(TOKENS, 4, t1), hash_blocks(TOKENS, 4, t2)) == 2


def test_block_extra_keys_are_empty_without_keys() -> None:
    assert not HashContext().has_block_keys
    assert HashContext().block_extra_keys(0, 4) == b""
    assert CTX.has_block_keys


@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=6),
    block_size=st.integers(1, 9),
    keyed=st.booleans(),
)
def test_incremental_extend_equals_one_shot(
    tokens: list[int], cuts: list[int], block_size: int, keyed: bool
) -> None:
    ctx = CTX if keyed else HashContext()
    chain = BlockHashChain(block_size, ctx)
    new: list[bytes] = []
    start = 0
    for cut in [*sorted(c for c in cuts if c <= len(tokens)), len(tokens)]:
        new.extend(chain.extend(tokens[start:cut]))
        start = cut
    expected = hash_blocks(tokens, block_size, ctx)
    assert chain.hashes == expected
    assert new == expected  # extend returns exactly the blocks each call completed


def test_numpy_ints_hash_like_python_ints() -> None:
    expected = hash_blocks(TOKENS, 4, CTX)
    for dtype in (np.int32, np.int64, np.uint32, np.uint64):
        assert hash_blocks(np.array(TOKENS, dtype=dtype), 4, CTX) == expected
    assert hash_blocks([np.int64(t) for t in TOKENS], 4, CTX) == expected
    chain = BlockHashChain(4, CTX)
    chain.extend([np.int16(t % 30000) for t in TOKENS[:3]])
    assert len(chain.hashes) == 0


@pytest.mark.parametrize("bad", [-1, 2**32, 2**64, -(2**40)])
def test_token_outside_uint32_is_rejected_and_chain_unchanged(bad: int) -> None:
    chain = BlockHashChain(4)
    chain.extend([1, 2])
    before = (list(chain.hashes), chain.copy().tail)
    for tokens in ([bad], [3, 4, 5, 6, 7, bad], [3, 4, bad, 6]):
        with pytest.raises(InvalidRequestError):
            chain.extend(tokens)
        assert (list(chain.hashes), chain.copy().tail) == before


def test_float_tokens_are_rejected() -> None:
    with pytest.raises(InvalidRequestError):
        hash_blocks([1.0, 2.0, 3.0, 4.0], 4)  # type: ignore[list-item]


def test_encode_key_separates_types_and_nesting() -> None:
    keys = [1, "1", b"1", (1,), ((1,),), ("a", "b"), ("ab",), -1, 0]
    assert len({encode_key(k) for k in keys}) == len(keys)
    with pytest.raises(InvalidRequestError):
        encode_key(True)
    with pytest.raises(InvalidRequestError):
        encode_key(1.5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "make",
    [
        lambda: MultiModalItem("x", offset=-1, length=2),
        lambda: MultiModalItem("x", offset=0, length=0),
        lambda: RangeKey(3, 3, "k"),
        lambda: RangeKey(-1, 3, "k"),
        lambda: BlockHashChain(0),
        lambda: hash_function("md5"),
    ],
    ids=["mm-offset", "mm-length", "range-empty", "range-negative", "block-size", "algo"],
)
def test_bad_hash_inputs_raise_invalid_request(make: object) -> None:
    with pytest.raises(InvalidRequestError):
        make()  # type: ignore[operator]


def test_copy_is_independent() -> None:
    chain = BlockHashChain(4)
    chain.extend([1, 2, 3, 4, 5])
    clone = chain.copy()
    clone.extend([6, 7, 8])
    assert len(chain.hashes) == 1
    assert len(clone.hashes) == 2
    chain.extend([9, 9, 9])
    assert chain.hashes[1] != clone.hashes[1]


def test_importing_core_does_not_import_torch() -> None:
    code = "import sys, pagedkv.core; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
