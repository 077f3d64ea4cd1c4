"""pagedkv's GGUF dequantizers against the gguf package's reference (a port of ggml's
``dequantize_row_*``): bit-identical float32 on random blocks and on quantized real values."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.engine.gguf_quants import SUPPORTED_TYPES, dequantize
from pagedkv.errors import ModelLoadError

gguf = pytest.importorskip("gguf")
GT = gguf.GGMLQuantizationType

# byte offsets of the float16 scales/mins inside one block of each type
_F16_FIELDS = {
    "Q8_0": (0,),
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def _random_blocks(type_name: str, num_blocks: int, seed: int) -> np.ndarray:
    """Random bytes for every field, with finite float16 scales (random bytes there would be
    NaN/inf about 1 time in 32, which says nothing about the unpacking)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[GT[type_name]]
    if block_size == 1:  # plain floats: finite random values of that width
        values = rng.standard_normal(num_blocks).astype(np.float32) * 3
        if type_name == "F16":
            return values.astype(np.float16).view(np.uint8)
        if type_name == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.view(np.uint8)
    raw = rng.integers(0, 256, size=(num_blocks, type_size), dtype=np.uint8)
    for offset in _F16_FIELDS[type_name]:
        scales = (rng.standard_normal(num_blocks) * 0.05).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(num_blocks, 2)
    return raw.reshape(-1)


@pytest.mark.parametrize("type_name", SUPPORTED_TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_blocks_dequantize_bit_identical_to_gguf_reference(
    type_name: str, seed: int
) -> None:
    block_size, _ = gguf.GGML_QUANT_SIZES[GT[type_name]]
    num_blocks = 257 if block_size > 1 else 4099
    raw = _random_blocks(type_name, num_blocks, seed)
    expected = gguf.quants.dequantize(raw.reshape(1, -1), GT[type_name]).reshape(-1)
    got = dequantize(raw, type_name, num_blocks * block_size)
    assert got.dtype == np.float32
    assert got.shape == (num_blocks * block_size,)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got.view(np.uint32), expected.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16"])
def test_quantized_values_round_trip_like_the_reference(type_name: str) -> None:
    """Values quantized by gguf's quantizer come back exactly as the reference returns them,
    and close to the originals (the quantization error bound of 4-bit blocks)."""
    values = np.random.default_rng(7).standard_normal((64, 256)).astype(np.float32)
    packed = gguf.quants.quantize(values, GT[type_name])
    expected = gguf.quants.dequantize(packed, GT[type_name]).reshape(-1)
    got = dequantize(packed, type_name, values.size)
    np.testing.assert_array_equal(got, expected)
    assert np.abs(got - values.reshape(-1)).max() < 0.5


def test_unsupported_type_is_refused_by_name() -> None:
    with pytest.raises(ModelLoadError, match="IQ2_XXS"):
        dequantize(np.zeros(66, dtype=np.uint8), "IQ2_XXS", 256)


def test_byte_count_that_does_not_match_the_shape_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="needs 68 bytes"):
        dequantize(np.zeros(67, dtype=np.uint8), "Q8_0", 64)
    with pytest.raises(ModelLoadError, match="blocks of 32"):
        dequantize(np.zeros(34, dtype=np.uint8), "Q8_0", 31)
