"""Dequantization of GGUF tensor data (ggml's block formats) to float32, vectorised with numpy.

Each format stores a tensor as a run of fixed-size blocks; a block holds ``block_size`` values and
takes ``type_size`` bytes. Every function here takes the blocks as a ``[num_blocks, type_size]``
uint8 array and returns ``[num_blocks, block_size]`` float32, computing each value with the same
float32 operations, in the same order, as ggml's reference ``dequantize_row_*`` (so the results are
bit-identical to it; ``tests/unit/test_gguf_quants.py`` checks that against the ``gguf`` package).

Supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K. Any other type raises
:class:`ModelLoadError` naming it.

Layouts (bytes per block; ``d``/``m`` are float16 scale/min, ``qs`` packed quants)::

    Q8_0  d | qs[32] int8                         x = qs * d
    Q4_0  d | qs[16]        nibbles: j -> low of qs[j], j+16 -> high     x = d * (q - 8)
    Q4_1  d m | qs[16]                            x = d * q + m
    Q5_0  d | qh u32 | qs[16]   bit j of qh is bit 4 of value j          x = d * (q - 16)
    Q5_1  d m | qh u32 | qs[16]                   x = d * q + m
    Q4_K  d dmin | scales[12] (8 x 6-bit scale, 8 x 6-bit min) | qs[128]   x = d*sc * q - dmin*mn
    Q5_K  as Q4_K plus qh[32] before qs (bit s of qh[l] is bit 4 of sub-block s, element l)
    Q6_K  ql[128] | qh[64] | scales[16] int8 | d        x = d*sc * (q - 32)
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from pagedkv.errors import ModelLoadError

U8 = npt.NDArray[np.uint8]
F32 = npt.NDArray[np.float32]

QK_K = 256  # values per K-quant super-block
_NIBBLE_SHIFTS = np.array([0, 4], dtype=np.uint8)


def _f16(blocks: U8, start: int) -> F32:
    """The float16 at byte ``start`` of every block, as a ``[num_blocks, 1]`` float32 column."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs: U8, group: int) -> U8:
    """Split packed 4-bit values: for each run of ``group`` bytes, the low nibbles come first,
    then the high ones (ggml's order). ``[n, k]`` bytes -> ``[n, 2k]`` values in 0..15."""
    n = qs.shape[0]
    halves = qs.reshape(n, -1, 1, group) >> _NIBBLE_SHIFTS.reshape(1, 1, 2, 1)
    return (halves & np.uint8(0x0F)).reshape(n, -1)


def _qh_bits(blocks: U8, start: int) -> U8:
    """Bit j (0..31) of the little-endian uint32 at byte ``start``, as ``[num_blocks, 32]``."""
    qh = blocks[:, start : start + 4].copy().view("<u4")
    bits = qh >> np.arange(32, dtype=np.uint32).reshape(1, 32)
    return (bits & np.uint32(1)).astype(np.uint8)


def _float32(blocks: U8) -> F32:
    return blocks.copy().view("<f4")


def _float16(blocks: U8) -> F32:
    return blocks.copy().view("<f2").astype(np.float32)


def _bfloat16(blocks: U8) -> F32:
    wide = blocks.copy().view("<u2").astype(np.uint32) << np.uint32(16)
    return wide.view(np.float32)


def _q8_0(blocks: U8) -> F32:
    d = _f16(blocks, 0)
    return blocks[:, 2:].view(np.int8).astype(np.float32) * d


def _q4_0(blocks: U8) -> F32:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:], 16).astype(np.int8) - np.int8(8)
    return d * q.astype(np.float32)


def _q4_1(blocks: U8) -> F32:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return d * _nibbles(blocks[:, 4:], 16).astype(np.float32) + m


def _q5_0(blocks: U8) -> F32:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 6:], 16) | (_qh_bits(blocks, 2) << np.uint8(4))
    return d * (q.astype(np.int8) - np.int8(16)).astype(np.float32)


def _q5_1(blocks: U8) -> F32:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:], 16) | (_qh_bits(blocks, 4) << np.uint8(4))
    return d * q.astype(np.float32) + m


def _k_scales_mins(packed: U8) -> tuple[F32, F32]:
    """Unpack Q4_K/Q5_K's 12 bytes into 8 six-bit scales and 8 six-bit mins per block.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the same
    for the mins; bytes 8-11 the low 4 bits of scale 4-7 (low nibble) and min 4-7 (high nibble).
    """
    n = packed.shape[0]
    lo, hi, extra = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([lo & 0x3F, (extra & 0x0F) | ((lo >> 2) & 0x30)], axis=1)
    mins = np.concatenate([hi & 0x3F, (extra >> 4) | ((hi >> 2) & 0x30)], axis=1)
    return scales.reshape(n, 8).astype(np.float32), mins.reshape(n, 8).astype(np.float32)


def _q4_k(blocks: U8) -> F32:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    scale = (d * sc).reshape(n, 8, 1)
    offset = (dmin * mn).reshape(n, 8, 1)
    q = _nibbles(blocks[:, 16:], 32).reshape(n, 8, 32).astype(np.float32)
    return (scale * q - offset).reshape(n, QK_K)


def _q5_k(blocks: U8) -> F32:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scales_mins(blocks[:, 4:16])
    scale = (d * sc).reshape(n, 8, 1)
    offset = (dmin * mn).reshape(n, 8, 1)
    low = _nibbles(blocks[:, 48:], 32).reshape(n, 8, 32)
    qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = (low | ((qh & np.uint8(1)) << np.uint8(4))).astype(np.float32)
    return (scale * q - offset).reshape(n, QK_K)


def _q6_k(blocks: U8) -> F32:
    n = blocks.shape[0]
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = _f16(blocks, 208)
    scale = (d * sc).reshape(n, 16, 1)
    low = _nibbles(ql, 64).reshape(n, 8, 32)  # per 128-value half: 64 low nibbles, 64 high
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    high = ((qh.reshape(n, 2, 1, 32) >> shifts) & np.uint8(3)).reshape(n, 8, 32)
    q = (low | (high << np.uint8(4))).astype(np.int8) - np.int8(32)
    return (scale * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, QK_K)


# ggml type name -> (values per block, bytes per block, dequantizer)
_FORMATS: dict[str, tuple[int, int, Callable[[U8], F32]]] = {
    "F32": (1, 4, _float32),
    "F16": (1, 2, _float16),
    "BF16": (1, 2, _bfloat16),
    "Q8_0": (32, 34, _q8_0),
    "Q4_0": (32, 18, _q4_0),
    "Q4_1": (32, 20, _q4_1),
    "Q5_0": (32, 22, _q5_0),
    "Q5_1": (32, 24, _q5_1),
    "Q4_K": (QK_K, 144, _q4_k),
    "Q5_K": (QK_K, 176, _q5_k),
    "Q6_K": (QK_K, 210, _q6_k),
}
SUPPORTED_TYPES = tuple(_FORMATS)

# Bytes dequantized per call: bounds the temporaries (a few x the output chunk) on big tensors.
_CHUNK_BYTES = 8 << 20


def dequantize(data: npt.NDArray[np.generic], type_name: str, num_values: int) -> F32:
    """Dequantize one tensor's raw bytes (any shape; read as bytes) of ggml type ``type_name``
    into a flat float32 array of ``num_values`` values. Raises ModelLoadError on an unsupported
    type or a byte count that does not match ``num_values``."""
    fmt = _FORMATS.get(type_name)
    if fmt is None:
        raise ModelLoadError(
            f"unsupported GGUF tensor type {type_name}; supported: {', '.join(SUPPORTED_TYPES)}"
        )
    block_size, type_size, fn = fmt
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if num_values % block_size or raw.size != num_values // block_size * type_size:
        raise ModelLoadError(
            f"{type_name} tensor of {num_values} values needs "
            f"{num_values // block_size * type_size} bytes in blocks of {block_size}; "
            f"got {raw.size} bytes"
        )
    blocks = raw.reshape(-1, type_size)
    out = np.empty((blocks.shape[0], block_size), dtype=np.float32)
    step = max(1, _CHUNK_BYTES // type_size)
    for start in range(0, blocks.shape[0], step):
        stop = start + step
        out[start:stop] = fn(blocks[start:stop])
    return out.reshape(-1)
