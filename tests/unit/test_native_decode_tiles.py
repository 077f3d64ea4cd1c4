"""The decode kernel's tiled arithmetic (``csrc/paged_decode.c``) against a float64 reference.

The kernel computes each block's scores in tiles of 4 positions x up to 3 queries and its
P.V product in tiles of 16 lanes of head_dim x up to 3 queries, with tails for everything
that does not fill a tile. The grid here makes every tail happen: block sizes 1/16/32
(fewer than 4 rows, exact tiles), head_dim 64/96/128 (96 = 6 chunks of 16, tails of none)
and 72 (a 16-lane tail of 8), groups 1/3/8 (8 = 3 + 3 + 2 query tiles), lengths that end
inside a block, and sliding-window starts inside the first block. Both builds are checked:
the default (AVX2 + FMA intrinsics where the CPU has them) and the portable one (no
``-march=native``: the plain-loop tiles).

Tolerance: ``atol=2e-5, rtol=1e-4`` against float64, as ``test_engine_native.py``. The
kernel's float32 sums change order with the tiling (4 x 8-lane partial sums for Q.K, row
order for P.V); each output is a convex combination of V rows (|v| <= ~4) whose weights
carry a relative error of a few float32 epsilons (~1e-7) per term over at most
head_dim + block_size terms, so ~1e-5 absolute is the worst case and 2e-5 leaves room
without admitting a wrong answer (a dropped row or a mis-scaled tile is off by ~1e-2).
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from pagedkv.engine import native  # noqa: E402

pytestmark = pytest.mark.engine

if not native.available():
    pytest.skip(
        f"native kernel unavailable: {native.unavailable_reason()}", allow_module_level=True
    )


def _bind(lib: ctypes.CDLL) -> Any:
    fn = lib.pagedkv_decode_f32
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_float]
    fn.restype = ctypes.c_int
    return fn


@pytest.fixture(scope="module", params=["default", "portable"])
def kernel(request: pytest.FixtureRequest) -> Any:
    if request.param == "default":
        return _bind(native.compile_library(native._SOURCE))
    portable = tuple(fs for fs in native._FLAG_SETS if "-march=native" not in fs[0])
    return _bind(native.compile_library(native._SOURCE, portable))


def _reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:  # q [heads, d], k/v [kv_heads, ctx, d], float64 throughout
    group = q.shape[0] // k.shape[0]
    k = k.double().repeat_interleave(group, 0)
    v = v.double().repeat_interleave(group, 0)
    p = torch.softmax(torch.einsum("hd,hkd->hk", q.double(), k) * scale, -1)
    return torch.einsum("hk,hkd->hd", p, v)


def _case(block_size: int, head_dim: int, group: int, sharp: float) -> tuple[torch.Tensor, ...]:
    num_kv = 2
    gen = torch.Generator().manual_seed(block_size * 1009 + head_dim * 31 + group)
    lens = [1, 2, 5, block_size + 1, 3 * block_size - 1, 37, 70]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    k = torch.randn(num_kv, num_blocks, block_size, head_dim, generator=gen)
    v = torch.randn(num_kv, num_blocks, block_size, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // block_size) for n in lens)
    tables = torch.zeros(len(lens), width, dtype=torch.int64)
    for s, n in enumerate(lens):
        tables[s, : -(-n // block_size)] = torch.tensor(
            [order.pop() for _ in range(-(-n // block_size))]
        )
    # odd rows: a window start inside the first block, 0 <= start < min(len, block_size)
    starts = torch.tensor(
        [(7 * s + 3) % min(n, block_size) if s % 2 else 0 for s, n in enumerate(lens)]
    )
    q = torch.randn(len(lens), num_kv * group, head_dim, generator=gen) * sharp
    return q, k, v, tables, torch.tensor(lens), starts


@pytest.mark.parametrize("block_size", [1, 16, 32])
@pytest.mark.parametrize("head_dim", [64, 72, 96, 128])
@pytest.mark.parametrize("group", [1, 3, 8])
def test_tiles_match_float64_over_odd_shapes(
    kernel: Any, block_size: int, head_dim: int, group: int
) -> None:
    # sharp=4: scores of ~+-10, so the running max moves between blocks and the rescaling of
    # the accumulators is exercised, not only the first block's exponentials
    for sharp in (1.0, 4.0):
        q, k, v, tables, lens, starts = _case(block_size, head_dim, group, sharp)
        out = torch.full_like(q, float("nan"))
        scale = head_dim**-0.5
        code = kernel(
            q.data_ptr(), out.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(),
            lens.data_ptr(), starts.data_ptr(), q.shape[0], tables.shape[1], q.shape[1],
            k.shape[0], k.shape[1], block_size, head_dim, scale,
        )  # fmt: skip
        assert code == 0
        for s, n in enumerate(lens.tolist()):
            blocks = tables[s, : -(-n // block_size)]
            first = int(starts[s])
            ks = k[:, blocks].reshape(k.shape[0], -1, head_dim)[:, first:n]
            vs = v[:, blocks].reshape(k.shape[0], -1, head_dim)[:, first:n]
            want = _reference(q[s], ks, vs, scale)
            torch.testing.assert_close(out[s].double(), want, atol=2e-5, rtol=1e-4)


def test_the_builds_agree_with_each_other_closely(kernel: Any) -> None:
    """Same shapes through ``native.decode_attention`` (the default build) and the fixture's
    build: the portable loops and the intrinsics tile alike, so they agree far inside the
    float64 tolerance (not bit for bit: FMA contracts differently)."""
    q, k, v, tables, lens, starts = _case(16, 64, 3, 1.0)
    want = native.decode_attention(q, k, v, tables, lens, 0.125, starts=starts)
    out = torch.empty_like(q)
    code = kernel(
        q.data_ptr(), out.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(),
        lens.data_ptr(), starts.data_ptr(), q.shape[0], tables.shape[1], q.shape[1], k.shape[0],
        k.shape[1], 16, 64, 0.125,
    )  # fmt: skip
    assert code == 0
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
