"""Process settings the engine applies on the CPU: large step activations come from the heap,
not fresh mmaps; the startup heap is frozen out of the cyclic collector."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = [
    pytest.mark.engine,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux"),
]

# In a fresh process: allocate a 24 MiB activation and print how many bytes glibc holds in
# mmap'd blocks while it is alive (mallinfo2's hblkhd). A block served by mmap is faulted in
# page by page on every allocation; one from the heap is reused once freed.
_PROBE = textwrap.dedent(
    """
    import ctypes, sys, torch
    from pagedkv.engine.host_alloc import tune_host_allocator
    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]
    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        print("unsupported"); raise SystemExit
    libc.mallinfo2.restype = MallInfo2
    if sys.argv[1] == "tuned":
        print(tune_host_allocator())
    before = libc.mallinfo2().hblkhd
    x = torch.ones(6 << 20)
    print(libc.mallinfo2().hblkhd - before)
    """
)


def _probe(mode: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def test_tuned_allocator_serves_activations_from_the_heap() -> None:
    default = _probe("default")
    if default == ["unsupported"]:
        pytest.skip("this C library has no mallinfo2 (not glibc >= 2.33)")
    assert int(default[-1]) >= 24 << 20  # glibc's default: a fresh mmap for the block
    tuned = _probe("tuned")
    assert tuned[0] == "True"
    assert int(tuned[-1]) == 0  # tuned: from the heap, reused once freed


def test_engine_freezes_the_startup_heap_unless_asked_not_to(tmp_path: Path) -> None:
    from pagedkv.engine.engine_config import EngineConfig
    from pagedkv.engine.llm_engine import LLMEngine
    from pagedkv.engine.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path / "m")
    gc.unfreeze()
    LLMEngine.from_model_dir(str(model_dir), EngineConfig(freeze_gc_heap=False))
    assert gc.get_freeze_count() == 0
    LLMEngine.from_model_dir(str(model_dir), EngineConfig())
    assert gc.get_freeze_count() > 0
    gc.unfreeze()
