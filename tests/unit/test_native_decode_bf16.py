"""bfloat16 KV pools in the native decode kernel (``pagedkv_decode_bf16kv``): each block is
widened into float32 scratch as it is read, so the result is the float32 entry's on the
widened pools bit for bit (both builds: AVX2 and portable), within the float64 tolerance of
``test_native_decode_tiles.py``, and mixed or wrong pool dtypes are refused."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pagedkv.engine import native  # noqa: E402
from pagedkv.errors import InvalidRequestError  # noqa: E402

pytestmark = pytest.mark.engine

if not native.available():
    pytest.skip(
        f"native kernel unavailable: {native.unavailable_reason()}", allow_module_level=True
    )


@pytest.fixture(scope="module", params=["default", "portable"])
def lib(request: pytest.FixtureRequest) -> Any:
    flags = native._FLAG_SETS
    if request.param == "portable":
        flags = tuple(fs for fs in flags if "-march=native" not in fs[0])
    built = native.compile_library(native._SOURCE, flags)
    native._bind(built)
    return built


def _case(block_size: int, head_dim: int, group: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(block_size * 7 + head_dim + group)
    lens = [1, 3, block_size + 2, 2 * block_size + 5, 40]
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    shape = (2, num_blocks, block_size, head_dim)
    k = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    v = torch.randn(*shape, generator=gen).to(torch.bfloat16)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    for s, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[s, :nb] = torch.tensor([order.pop() for _ in range(nb)])
    starts = torch.tensor([(3 * s + 1) % min(n, block_size) if s % 2 else 0
                           for s, n in enumerate(lens)])  # fmt: skip
    q = torch.randn(len(lens), 2 * group, head_dim, generator=gen) * 2
    return q, k, v, tables, torch.tensor(lens), starts


def _call(fn: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
          lens: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:  # fmt: skip
    out = torch.full_like(q, float("nan"))
    code = fn(
        q.data_ptr(), out.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(),
        lens.data_ptr(), starts.data_ptr(), q.shape[0], tables.shape[1], q.shape[1], k.shape[0],
        k.shape[1], k.shape[2], k.shape[3], ctypes.c_float(k.shape[3] ** -0.5),
    )  # fmt: skip
    assert code == 0
    return out


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 72])
@pytest.mark.parametrize("group", [1, 3])
def test_bf16_pools_give_the_float32_kernels_bits_on_the_widened_pools(
    lib: Any, block_size: int, head_dim: int, group: int
) -> None:
    q, k, v, tables, lens, starts = _case(block_size, head_dim, group)
    got = _call(lib.pagedkv_decode_bf16kv, q, k, v, tables, lens, starts)
    want = _call(lib.pagedkv_decode_f32, q, k.float(), v.float(), tables, lens, starts)
    assert torch.equal(got, want)
    for s, n in enumerate(lens.tolist()):  # and the float64 reference (the tiles' tolerance)
        blocks, first = tables[s, : -(-n // block_size)], int(starts[s])
        ks = k[:, blocks].reshape(2, -1, head_dim)[:, first:n].double()
        vs = v[:, blocks].reshape(2, -1, head_dim)[:, first:n].double()
        kr, vr = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        p = torch.softmax(torch.einsum("hd,hkd->hk", q[s].double(), kr) * head_dim**-0.5, -1)
        ref = torch.einsum("hk,hkd->hd", p, vr)
        torch.testing.assert_close(got[s].double(), ref, atol=2e-5, rtol=1e-4)


def test_the_python_entry_takes_bf16_pools_and_refuses_mixed_ones() -> None:
    q, k, v, tables, lens, starts = _case(16, 64, 3)
    got = native.decode_attention(q, k, v, tables, lens, 0.125, starts=starts)
    want = native.decode_attention(q, k.float(), v.float(), tables, lens, 0.125, starts=starts)
    assert torch.equal(got, want)
    with pytest.raises(InvalidRequestError, match="unsupported"):
        native.decode_attention(q, k, v.float(), tables, lens, 0.125)
    with pytest.raises(InvalidRequestError, match="unsupported"):
        native.decode_attention(q, k.half(), v.half(), tables, lens, 0.125)
    prepared = native.PreparedDecode(k, v, tables, lens, 0.125, q.shape[1], threads=1)
    out = torch.empty_like(q)
    with pytest.raises(InvalidRequestError, match="do not match"):  # prepared for bf16 pools
        prepared(q, out, k.float(), v.float())
    bound = prepared.bind(q, out, k, v)
    assert bound is not None
    bound(k, v)
    assert torch.equal(out, native.decode_attention(q, k, v, tables, lens, 0.125))
    with pytest.raises(InvalidRequestError, match="prepared"):
        bound(k.float(), v.float())
