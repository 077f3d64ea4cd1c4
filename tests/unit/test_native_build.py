"""``native_build.LazyLibrary``: built once, ``bind``'s result kept, a refusal remembered."""

from __future__ import annotations

import ctypes
import logging
import shutil
from pathlib import Path

import pytest

from pagedkv.engine import native_build

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler"
)


@pytest.fixture
def source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PAGEDKV_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "answer.c"
    path.write_text("int answer(void) { return 42; }\n")
    return path


def test_bind_runs_once_and_its_result_is_kept(source: Path) -> None:
    calls: list[ctypes.CDLL] = []

    def bind(lib: ctypes.CDLL) -> int:
        calls.append(lib)
        lib.answer.restype = ctypes.c_int
        return int(lib.answer())

    lazy = native_build.LazyLibrary(source, bind, "answer kernel", "using Python")
    assert lazy.lib is None
    assert lazy.bound is None
    lib = lazy.load()
    assert lib is not None
    assert lazy.load() is lib
    assert lazy.bound == 42
    assert lazy.reason() is None
    assert len(calls) == 1


def test_a_refused_library_is_remembered_and_never_retried(
    source: Path, caplog: pytest.LogCaptureFixture
) -> None:
    calls = 0

    def bind(lib: ctypes.CDLL) -> int:
        nonlocal calls
        calls += 1
        raise OSError("answer differs from Python's")

    lazy = native_build.LazyLibrary(source, bind, "answer kernel", "using Python")
    with caplog.at_level(logging.WARNING, logger="pagedkv.engine.native_build"):
        assert lazy.load() is None
        assert lazy.load() is None
    assert calls == 1
    assert lazy.lib is None
    assert lazy.bound is None
    assert lazy.reason() == "answer differs from Python's"
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["answer kernel unavailable (answer differs from Python's); using Python"]


def test_a_source_that_does_not_compile_names_the_compiler_error(source: Path) -> None:
    source.write_text("int answer(void) { return }\n")
    lazy = native_build.LazyLibrary(source, lambda lib: None, "answer kernel", "using Python")
    assert lazy.load() is None
    assert lazy.error is not None
    assert "error" in lazy.error


def test_every_kernel_loads_on_a_cpu_torch_dispatches_to_with_vectors() -> None:
    """With a compiler, on an AVX2/AVX512 CPU, no kernel may be refused: the suite would
    otherwise go green by skipping them (the layer ops were refused on an AVX512 CPU, and
    every test of theirs skipped, until their load check probed torch's lane order)."""
    import torch

    from pagedkv.engine import bf16_linear, fewrow, gguf_qlinear, layer_ops, qlinear

    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip(f"torch dispatches to {torch.backends.cpu.get_cpu_capability()} here")
    assert layer_ops.available(), layer_ops.unavailable_reason()
    assert bf16_linear.available(), bf16_linear.unavailable_reason()
    assert qlinear.available()
    assert fewrow.available()
    assert gguf_qlinear.available()
