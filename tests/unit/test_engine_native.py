"""The native decode kernel against dense attention: shapes, block tables, errors, selection."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from pagedkv.engine import native  # noqa: E402
from pagedkv.errors import InvalidRequestError  # noqa: E402

pytestmark = pytest.mark.engine

if not native.available():
    pytest.skip(
        f"native kernel unavailable: {native.unavailable_reason()}", allow_module_level=True
    )


def _dense(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:  # q [heads, d], k/v [kv_heads, ctx, d]
    group = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(group, 0)
    v = v.repeat_interleave(group, 0)
    p = torch.softmax(torch.einsum("hd,hkd->hk", q.double(), k.double()) * scale, -1)
    return torch.einsum("hk,hkd->hd", p, v.double()).float()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    num_kv=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 2, 3, 8]),
    head_dim=st.sampled_from([8, 24, 64, 100, 128]),
    block_size=st.sampled_from([1, 3, 16, 32]),
)
def test_matches_dense_attention(
    data: st.DataObject, num_kv: int, group: int, head_dim: int, block_size: int
) -> None:
    lens = data.draw(st.lists(st.integers(1, 70), min_size=1, max_size=6))
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    seed = data.draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, num_kv, num_blocks, block_size, head_dim, generator=gen)
    order = torch.randperm(num_blocks, generator=gen).tolist()  # scattered tables
    width = max(-(-n // block_size) for n in lens) + data.draw(st.integers(0, 2))
    tables = np.zeros((len(lens), width), dtype=np.int64)
    for s, n in enumerate(lens):
        need = -(-n // block_size)
        tables[s, :need] = [order.pop() for _ in range(need)]
    heads = num_kv * group
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    out = native.decode_attention(
        q, pool[0], pool[1], torch.from_numpy(tables), torch.tensor(lens), scale
    )
    for s, n in enumerate(lens):
        blocks = torch.from_numpy(tables[s, : -(-n // block_size)])
        k = pool[0][:, blocks].reshape(num_kv, -1, head_dim)[:, :n]
        v = pool[1][:, blocks].reshape(num_kv, -1, head_dim)[:, :n]
        torch.testing.assert_close(out[s], _dense(q[s], k, v, scale), atol=2e-5, rtol=1e-4)


def _inputs() -> tuple[torch.Tensor, ...]:
    pool = torch.randn(2, 2, 8, 4, 16)
    q = torch.randn(2, 4, 16)
    return q, pool[0], pool[1], torch.tensor([[1, 2], [3, 0]]), torch.tensor([7, 3])


def test_bad_inputs_raise_typed_errors_and_write_nothing_outside() -> None:
    q, k, v, tables, lens = _inputs()
    assert native.decode_attention(q, k, v, tables, lens, 0.25).shape == q.shape
    with pytest.raises(InvalidRequestError, match="out of range"):
        native.decode_attention(q, k, v, torch.tensor([[1, 8], [3, 0]]), lens, 0.25)
    with pytest.raises(InvalidRequestError, match="out of range"):
        native.decode_attention(q, k, v, tables, torch.tensor([7, 0]), 0.25)
    with pytest.raises(InvalidRequestError, match="unsupported"):  # table too short
        native.decode_attention(q, k, v, tables, torch.tensor([9, 3]), 0.25)
    with pytest.raises(InvalidRequestError, match="unsupported"):
        native.decode_attention(q.double(), k, v, tables, lens, 0.25)
    with pytest.raises(InvalidRequestError, match="unsupported"):
        native.decode_attention(q, k, v, tables.int(), lens, 0.25)
    with pytest.raises(InvalidRequestError, match="unsupported"):  # 4 heads over 3 KV heads
        native.decode_attention(q, k[:1].expand(3, -1, -1, -1), v, tables, lens, 0.25)


def test_supports_names_the_limits() -> None:
    assert native.supports(32, 8, 16, 128, torch.float32)
    assert native.supports(32, 8, 16, 128, torch.bfloat16)  # pools widened on load
    assert not native.supports(32, 8, 16, 128, torch.float16)
    assert not native.supports(32, 8, 512, 128, torch.float32)
    assert not native.supports(32, 8, 16, 1024, torch.float32)
    assert not native.supports(12, 8, 16, 64, torch.float32)


def test_loading_the_kernel_keeps_denormals() -> None:
    """The kernel is compiled with -ffast-math but not linked with it: linking would turn on
    flush-to-zero for the whole process (crtfastmath), and denormal floats would read 0."""
    assert native.available()
    tiny = 5e-324  # the smallest double, a denormal
    assert tiny / 1.0 != 0.0
    assert float(torch.tensor(1e-40, dtype=torch.float32) * 1.0) != 0.0


def test_without_a_compiler_auto_falls_back_and_native_is_a_clear_error(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        from pagedkv.engine import native
        from pagedkv.engine.engine_config import EngineConfig
        from pagedkv.engine.llm_engine import LLMEngine
        from pagedkv.engine.tiny import write_tiny_model
        from pagedkv.errors import InvalidRequestError
        import torch
        torch.set_num_threads(1)
        model = write_tiny_model({str(tmp_path / "m")!r})
        engine = LLMEngine.from_model_dir(str(model), EngineConfig(decode_kernel="auto"))
        print("auto native:", engine.runner.uses_native_decode())
        try:
            LLMEngine.from_model_dir(str(model), EngineConfig(decode_kernel="native"))
        except InvalidRequestError as exc:
            print("native error:", exc)
        """
    )
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "PAGEDKV_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert "auto native: False" in out
    assert "native error: decode_kernel='native': the kernel could not be built" in out


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_rows_shared_among_threads_give_the_same_bits(
    monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    monkeypatch.setattr(native, "_MIN_POSITIONS_PER_THREAD", 1)  # split even small batches
    gen = torch.Generator().manual_seed(11)
    lens = torch.randint(1, 90, (7,), generator=gen)
    pool = torch.randn(2, 2, 96, 8, 16, generator=gen)
    tables = torch.randperm(96, generator=gen)[: 7 * 12].view(7, 12).contiguous()
    q = torch.randn(7, 4, 16, generator=gen)
    cuts = native._split(lens, threads)
    assert cuts[0] == 0
    assert cuts[-1] == 7
    assert 2 < len(cuts) <= min(threads, 7) + 1  # rows really were shared out
    assert cuts == sorted(set(cuts))
    one = native.decode_attention(q, pool[0], pool[1], tables, lens, 0.3, threads=1)
    many = native.decode_attention(q, pool[0], pool[1], tables, lens, 0.3, threads=threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("threads", [2, 3, 16])
def test_one_call_split_on_openmp_threads_gives_the_same_bits(threads: int) -> None:
    """Built with OpenMP, one call shares whole rows of about equal context among the threads
    (at least 256 positions a part): every row's result is the one-thread call's, bit for
    bit, in float32 and bf16 pools."""
    lib = native._KERNEL.load()
    if lib is None or not lib.pagedkv_decode_openmp():
        pytest.skip("the decode kernel is not built with OpenMP here")
    gen = torch.Generator().manual_seed(12)
    lens = torch.randint(200, 700, (9,), generator=gen)
    lens[4] = 1  # a one-position row among long ones
    cuts = torch.zeros(17, dtype=torch.int64)
    parts = lib.pagedkv_decode_cuts(lens.data_ptr(), 9, threads, cuts.data_ptr())
    assert 2 <= parts <= min(threads, 9, int(lens.sum()) // 256)  # really split
    assert cuts[0] == 0
    assert cuts[parts] == 9
    assert bool((cuts[1 : parts + 1] > cuts[:parts]).all())  # no empty part
    pool = torch.randn(2, 2, 400, 16, 32, generator=gen)
    tables = torch.randperm(400, generator=gen)[: 9 * 44].view(9, 44).contiguous()
    q = torch.randn(9, 6, 32, generator=gen)
    for k, v in ((pool[0], pool[1]), (pool[0].bfloat16(), pool[1].bfloat16())):
        one = native.decode_attention(q, k, v, tables, lens, 0.2, threads=1)
        assert torch.equal(
            native.decode_attention(q, k, v, tables, lens, 0.2, threads=threads), one
        )


def test_small_batches_stay_on_the_calling_thread() -> None:
    assert native._split(torch.tensor([100, 200, 300]), 8) == [0, 3]
    big = torch.full((8,), 4096)
    cuts = native._split(big, 4)
    assert cuts == [0, 2, 4, 6, 8]  # equal contexts: equal runs
