"""Loading pagedkv's native libraries leaves the process's floating-point state alone.

A shared object linked with -ffast-math runs crtfastmath.o's constructor when it is loaded,
which turns on flush-to-zero and denormals-are-zero for the whole process: every subnormal in
torch, numpy and Python arithmetic becomes 0 from then on (hypothesis refuses to draw floats
in such a process). ``native.compile_library`` passes -ffast-math to the compiler only; this
test loads each library the engine builds and checks that subnormals still exist."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from pagedkv.engine import gguf_qlinear, layer_ops, native, qlinear  # noqa: E402

SUBNORMAL = 1e-40  # below float32's smallest normal (1.18e-38)


def _subnormals_survive() -> bool:
    a = np.float32(SUBNORMAL) * np.float32(1.0)
    t = torch.tensor([SUBNORMAL], dtype=torch.float32) * 1.0
    return bool(a != 0) and bool(t.item() != 0)


def test_loading_every_native_library_keeps_subnormals() -> None:
    assert _subnormals_survive()
    loaded = [native.available(), qlinear.available(), gguf_qlinear.available()]
    loaded.append(layer_ops.available())
    if not any(loaded):
        pytest.skip("no C compiler: no native library was loaded")
    assert _subnormals_survive(), f"a native library turned on flush-to-zero (loaded: {loaded})"
