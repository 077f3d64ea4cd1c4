"""The native decode-attention kernel alone: this tree's ``csrc/paged_decode.c`` against a
baseline version of the same file, both built into this process and called alternately.

Run ``python benchmarks/bench_decode_kernel.py`` (2-3 minutes on 2 cores); ``--quick`` for a
smoke run; ``--json PATH`` writes every row; ``--baseline REV`` names the git revision whose
``paged_decode.c`` is the baseline (default ``main``; the file is read with ``git show`` and
built with the same flags as this tree's); ``--only kernel|step1|step16``. ``--clock``
defaults to the thread CPU clock: the kernel and the engine run on one thread (torch's
threads are set to 1).

kernel  the kernel alone. Shape: SmolLM2-135M's attention (9 query heads over 3 KV heads,
        head_dim 64, block 16, one layer's pool), float32, scattered block tables; batch 1
        and 16 sequences at contexts 256, 1,024 and 4,096 tokens. ``GFLOP/s`` counts
        4 x head_dim flops per (query head, position): one multiply-add per element for Q.K
        and one for P.V; softmax work is not counted. Both builds' outputs are compared with
        a float64 reference before timing (a fast wrong kernel is not a result).
step1   the engine's batch-1 decode step on ``--model`` (default: the SmolLM2-135M GGUF when
        installed, else the tiny random Llama of bench_engine), prompt 32, with every linear
        layer stubbed (bench_engine's ``overhead`` model): ms per step, the two kernels'
        steps alternating round by round on one engine (its contexts grow alike for both).
step16  the same with 16 requests (prompts 16..256, as bench_engine's decode16) and the real
        linear layers: ms per step.
The engine rows swap which built library the decode kernel calls (``native._KERNEL.lib``)
between rounds; everything else is the same process, engine and state.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from _harness import (
    REPO_ROOT,
    Case,
    add_ratios,
    base_parser,
    print_table,
    run_cases,
    selected_fixtures,
    set_clock,
    write_json,
)
from _smollm2 import gguf_path
from bench_engine import MODEL, stub_linears
from pagedkv.engine import native
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model

FIXTURES = ("kernel", "step1", "step16")
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SOURCE = Path("src/pagedkv/engine/csrc/paged_decode.c")


def _build(path: Path) -> ctypes.CDLL:
    lib = native.compile_library(path)
    native._bind(lib)  # the engine's own signatures
    return lib


def _baseline(rev: str, tmp: Path) -> ctypes.CDLL:
    text = subprocess.run(
        ["git", "show", f"{rev}:{SOURCE}"], cwd=REPO_ROOT, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    path = tmp / "paged_decode.c"  # the same stem: the cache key is the source's bytes
    path.write_text(text)
    return _build(path)


def _inputs(seqs: int, ctx: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seqs * 100_003 + ctx)
    per = -(-ctx // BLOCK)
    num_blocks = seqs * per
    k = torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=gen)
    v = torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).reshape(seqs, per)
    q = torch.randn(seqs, HEADS, HEAD_DIM, generator=gen)
    lens = torch.full((seqs,), ctx, dtype=torch.int64)
    return {"q": q, "k": k, "v": v, "tables": tables, "lens": lens}


def _reference(x: dict[str, Any], scale: float) -> torch.Tensor:
    group = HEADS // KV_HEADS
    outs = []
    for s in range(x["q"].shape[0]):
        t = x["tables"][s]
        k = x["k"][:, t].reshape(KV_HEADS, -1, HEAD_DIM).double().repeat_interleave(group, 0)
        v = x["v"][:, t].reshape(KV_HEADS, -1, HEAD_DIM).double().repeat_interleave(group, 0)
        p = torch.softmax(torch.einsum("hd,hkd->hk", x["q"][s].double(), k) * scale, -1)
        outs.append(torch.einsum("hk,hkd->hd", p, v))
    return torch.stack(outs).float()


def _call(fn: Any, x: dict[str, Any], out: torch.Tensor, scale: float) -> None:
    seqs = x["q"].shape[0]
    code = fn(
        x["q"].data_ptr(), out.data_ptr(), x["k"].data_ptr(), x["v"].data_ptr(),
        x["tables"].data_ptr(), x["lens"].data_ptr(), None, seqs, x["tables"].shape[1], HEADS,
        KV_HEADS, x["k"].shape[1], BLOCK, HEAD_DIM, scale,
    )  # fmt: skip
    if code:
        raise RuntimeError(f"paged_decode_f32 returned {code}")


def kernel_cases(builds: dict[str, Any], quick: bool) -> list[Case]:
    scale = HEAD_DIM**-0.5
    out: list[Case] = []
    for seqs in (1, 16):
        for ctx in (256, 1024) if quick else (256, 1024, 4096):
            x = _inputs(seqs, ctx)
            ref = _reference(x, scale)
            flops = 4 * HEAD_DIM * HEADS * ctx * seqs
            calls = max(1, 2_000_000 // (seqs * ctx))
            for impl, lib in builds.items():
                fn = lib.pagedkv_decode_f32
                res = torch.empty_like(x["q"])
                _call(fn, x, res, scale)
                torch.testing.assert_close(res, ref, atol=2e-5, rtol=1e-4)

                def op(fn: Any = fn, x: dict[str, Any] = x, res: torch.Tensor = res) -> None:
                    _call(fn, x, res, scale)

                out.append(
                    Case(
                        "decode_attention", f"seqs={seqs} ctx={ctx}", impl, "call", op,
                        calls_per_round=calls, rounds=3 if quick else 7, warmup=3,
                        params={"seqs": seqs, "ctx": ctx, "flops": flops},
                    )
                )  # fmt: skip
    return out


def step_cases(builds: dict[str, ctypes.CDLL], model: Path, batch: int, quick: bool) -> list[Case]:
    engine = LLMEngine.from_model_dir(
        str(model),
        EngineConfig(block_size=16, num_blocks=1024, enable_prefix_caching=False,
                     decode_kernel="native"),
    )  # fmt: skip
    if batch == 1:
        stub_linears(engine)
    lengths = [32] if batch == 1 else [16 + (240 * i) // (batch - 1) for i in range(batch)]
    rounds, calls = (2, 4) if quick else (7, 20 if batch == 1 else 4)
    steps = len(builds) * (rounds + 2) * calls + 8
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for i, n in enumerate(lengths):
        engine.add_request(f"r{i}", list(range(2, 2 + n)), params)
    engine.step()  # the prefills
    kernel = native._KERNEL

    def step(lib: ctypes.CDLL) -> None:
        kernel.lib = lib  # the next step's PreparedDecode calls this build
        engine.step()

    def check() -> None:  # every step decoded all requests through the native kernel
        if not engine.runner.uses_native_decode() or len(engine.scheduler.running) != batch:
            raise RuntimeError(f"step{batch}: the engine did not decode {batch} natively")

    what = "linears stubbed" if batch == 1 else "real linears"
    case = f"batch={batch} prompts={min(lengths)}..{max(lengths)}, {what}"
    return [
        Case(f"step{batch}", case, impl, "step", lambda lib=lib: step(lib), calls_per_round=calls,
             rounds=rounds, warmup=2, interleave=f"step{batch}", check=check)
        for impl, lib in builds.items()
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--baseline", default="main", help="git revision of the baseline kernel")
    parser.add_argument("--model", type=Path, default=None, help="GGUF file or model folder")
    args = parser.parse_args(argv)
    set_clock(args.clock)
    only = selected_fixtures(parser, args, FIXTURES)
    torch.set_num_threads(1)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        builds = {
            "pagedkv": _build(REPO_ROOT / SOURCE),
            f"baseline ({args.baseline})": _baseline(args.baseline, Path(tmp)),
        }
        if "kernel" in only:
            results += run_cases(kernel_cases(builds, args.quick))
            for r in results:
                r.params["gflops"] = r.params["flops"] / r.timing.median_s / 1e9
                r.note = f"{r.params['gflops']:.1f} GFLOP/s"
        model = args.model or gguf_path() or write_tiny_model(Path(tmp) / "tiny", **MODEL)
        if not native.available():
            raise RuntimeError(f"the native kernel is unavailable: {native.unavailable_reason()}")
        own = native._KERNEL.lib
        try:
            for batch in (1, 16):
                if f"step{batch}" in only:
                    results += run_cases(step_cases(builds, model, batch, args.quick))
        finally:
            native._KERNEL.lib = own
    add_ratios(results)
    print_table("native decode attention: this tree's kernel vs the baseline's", results)
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
