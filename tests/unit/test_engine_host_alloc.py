"""Process settings the engine applies on the CPU: large step activations come from the heap,
not fresh mmaps; the startup heap is frozen out of the cyclic collector."""

from __future__ import annotations

import gc
import os
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


# --------------------------------------------------------------------------- huge pages
_REEXEC = textwrap.dedent(
    """
    import os, sys
    from pagedkv.engine.host_alloc import reexec_with_huge_pages
    reexec_with_huge_pages()
    huge = open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0]
    buf = bytearray(64 << 20)  # a large malloc after the re-exec: huge-page backed
    after = open("/proc/self/smaps_rollup").read().split("AnonHugePages:")[1].split()[0]
    print(os.getpid(), os.environ.get("GLIBC_TUNABLES"), int(after) - int(huge))
    print("|".join(sys.argv[1:]))
    """
)


def _huge_pages_here() -> bool:
    from pagedkv.engine.host_alloc import huge_page_env

    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "PAGEDKV_HUGE_PAGES")}
    return huge_page_env(env) is not None


def test_huge_page_env_adds_the_tunable_once_and_honours_the_opt_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagedkv.engine import host_alloc

    monkeypatch.setattr(host_alloc, "_glibc_at_least", lambda major, minor: True)
    monkeypatch.setattr(host_alloc, "_thp_allowed", lambda: True)
    tunable = host_alloc.HUGE_PAGE_TUNABLE
    assert host_alloc.huge_page_env({"A": "1"}) == {"A": "1", "GLIBC_TUNABLES": tunable}
    other = {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=5"}
    assert host_alloc.huge_page_env(other) == {
        "GLIBC_TUNABLES": f"glibc.malloc.trim_threshold=5:{tunable}"
    }
    assert host_alloc.huge_page_env({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}) is None
    assert host_alloc.huge_page_env({"GLIBC_TUNABLES": tunable}) is None  # no loop
    for off in ("0", "false", "Off", " no "):
        assert host_alloc.huge_page_env({"PAGEDKV_HUGE_PAGES": off}) is None
    assert host_alloc.huge_page_env({"PAGEDKV_HUGE_PAGES": "1"}) is not None
    monkeypatch.setattr(host_alloc, "_thp_allowed", lambda: False)
    assert host_alloc.huge_page_env({}) is None  # the kernel would refuse: no re-exec
    monkeypatch.setattr(host_alloc, "_thp_allowed", lambda: True)
    monkeypatch.setattr(host_alloc, "_glibc_at_least", lambda major, minor: False)
    assert host_alloc.huge_page_env({}) is None  # an older glibc ignores the tunable


@pytest.mark.skipif(not _huge_pages_here(), reason="no glibc >= 2.35 with THP here")
def test_reexec_keeps_the_process_and_its_arguments_and_gets_huge_pages() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "PAGEDKV_HUGE_PAGES")}
    proc = subprocess.Popen(
        [sys.executable, "-c", _REEXEC, "a b", "c"], env=env, stdout=subprocess.PIPE, text=True
    )
    out, _ = proc.communicate(timeout=60)
    first, argv = out.splitlines()
    pid, tunables, huge_kb = first.split()
    assert int(pid) == proc.pid  # the same process, re-executed
    assert tunables == "glibc.malloc.hugetlb=1"
    assert int(huge_kb) >= 32 << 10  # most of the 64 MiB buffer in 2 MiB pages
    assert argv == "a b|c"  # the arguments as they were, "a b" still one
    env["PAGEDKV_HUGE_PAGES"] = "0"
    off = subprocess.run(
        [sys.executable, "-c", _REEXEC], env=env, capture_output=True, text=True, check=True
    )
    assert off.stdout.split()[1:3] == ["None", "0"]  # opted out: no tunable, no huge pages


def test_only_model_commands_started_as_a_process_reexecute(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pagedkv import cli
    from pagedkv.engine import host_alloc

    calls: list[str] = []
    monkeypatch.setattr(host_alloc, "reexec_with_huge_pages", lambda: calls.append("exec"))
    monkeypatch.setattr(sys, "argv", ["pagedkv", "simulate", "--help"])
    with pytest.raises(SystemExit):
        cli.main()
    assert calls == []  # no model: no re-exec
    monkeypatch.setattr(sys, "argv", ["pagedkv", "generate", "--help"])
    with pytest.raises(SystemExit):
        cli.main()
    assert calls == ["exec"]
    with pytest.raises(SystemExit):
        cli.main(["generate", "--help"])  # called as a function: never replace the caller
    assert calls == ["exec"]
