"""The native decode-attention kernel alone: this tree's ``csrc/paged_decode.c`` against a
baseline version of the same file, both built into this process and called alternately.

Run ``python benchmarks/bench_decode_kernel.py`` (about a minute on 2 cores); ``--quick`` for a
smoke run; ``--json PATH`` writes every row; ``--baseline REV`` names the git revision whose
``paged_decode.c`` is the baseline (default ``main``; the file is read with ``git show`` and
built with the same flags as this tree's). ``--clock`` defaults to the thread CPU clock: each
call is one thread's work (one ctypes call over every row).

Shape: SmolLM2-135M's attention (9 query heads over 3 KV heads, head_dim 64, block 16, one
layer's pool), float32, scattered block tables; batch 1 and 16 sequences at contexts 256,
1,024 and 4,096 tokens. ``GFLOP/s`` counts 4 x head_dim flops per (query head, position):
one multiply-add per element for Q.K and one for P.V; softmax work is not counted. Both
builds' outputs are compared with a float64 reference before timing (a check that fails
raises: a fast wrong kernel is not a result).
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
    set_clock,
    write_json,
)
from pagedkv.engine import native

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SOURCE = Path("src/pagedkv/engine/csrc/paged_decode.c")


def _bind(lib: ctypes.CDLL) -> Any:
    fn = lib.pagedkv_decode_f32
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 7 + [ctypes.c_float]
    fn.restype = ctypes.c_int
    return fn


def _baseline(rev: str, tmp: Path) -> Any:
    text = subprocess.run(
        ["git", "show", f"{rev}:{SOURCE}"], cwd=REPO_ROOT, capture_output=True, text=True,
        check=True,
    ).stdout  # fmt: skip
    path = tmp / "paged_decode.c"  # the same stem: the cache key is the source's bytes
    path.write_text(text)
    return _bind(native.compile_library(path))


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


def cases(builds: dict[str, Any], quick: bool) -> list[Case]:
    scale = HEAD_DIM**-0.5
    out: list[Case] = []
    for seqs in (1, 16):
        for ctx in (256, 1024) if quick else (256, 1024, 4096):
            x = _inputs(seqs, ctx)
            ref = _reference(x, scale)
            flops = 4 * HEAD_DIM * HEADS * ctx * seqs
            calls = max(1, 2_000_000 // (seqs * ctx))
            for impl, fn in builds.items():
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


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--baseline", default="main", help="git revision of the baseline kernel")
    args = parser.parse_args(argv)
    set_clock(args.clock)
    with tempfile.TemporaryDirectory() as tmp:
        builds = {
            "pagedkv": _bind(native.compile_library(REPO_ROOT / SOURCE)),
            f"baseline ({args.baseline})": _baseline(args.baseline, Path(tmp)),
        }
        results = run_cases(cases(builds, args.quick))
    add_ratios(results)
    for r in results:
        gflops = r.params["flops"] / r.timing.median_s / 1e9
        r.params["gflops"] = gflops
        r.note = f"{gflops:.1f} GFLOP/s"
    print_table("native decode attention, SmolLM2 shape (9/3 heads, d=64, block 16)", results)
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
