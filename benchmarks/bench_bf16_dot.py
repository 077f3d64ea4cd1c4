"""The bf16 AMX kernel alone (``engine/bf16_dot.py``, ``--matmul-precision medium``) against
the float32-compute bf16 kernel (``engine/bf16_linear.py``, ``highest``) and torch's bf16
matmul (oneDNN; bf16 x bf16 with a bf16 output), on SmolLM2-135M's linear shapes.

Each implementation runs over 30 copies of each weight (one per layer, so the weights stream
from memory as in a decode step), rounds interleaved, and the table gives the minimum of
``--reps`` rounds per 30 calls, the weight bytes per second, and the multiply-adds per
second. Outputs go to buffers allocated once, as the engine's step buffers do (a new 12 MB
output per call costs page faults that the engine does not pay). Rows: 1 and 16 (decode:
bandwidth), 1,024 (prefill: compute). The vocabulary
projection (the tied embedding, ``[49152, 576]``) runs at 1 and 16 rows. A second table times
the SwiGLU MLP (gate/up, SiLU, down) three ways: the three AMX calls the engine made before
(gate/up into a float32 buffer, torch's SiLU, the down projection multiplying as it packs),
the one-call ``bf16_dot.mlp``, and torch's bf16 ops (oneDNN linears, bf16 SiLU and multiply).
Run ``python
benchmarks/bench_bf16_dot.py [--threads N] [--quick]`` (about a minute); it refuses to run
where AMX does not.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from pagedkv.engine import bf16_dot, bf16_linear
from pagedkv.engine.bf16_dot import PairedWeight
from pagedkv.engine.bf16_linear import TiledWeight

SHAPES = {"q/k/v": (576, 960), "o": (576, 576), "gate/up": (576, 3072), "down": (1536, 576)}
LAYERS = 30


def _best(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Minimum seconds per call of each function, rounds interleaved, after one warm call."""
    best = dict.fromkeys(fns, float("inf"))
    for fn in fns.values():
        fn()
    for _ in range(reps):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def _linear_row(name: str, in_dim: int, out: int, rows: int, reps: int) -> str:
    gen = torch.Generator().manual_seed(in_dim + out)
    ws = [torch.randn(in_dim, out, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    paired = [PairedWeight.from_weight_t(w) for w in ws]
    tiled = [TiledWeight.from_weight_t(w) for w in ws]
    w_nt = [w.t().contiguous() for w in ws]  # torch's fastest bf16 layout: x @ W.T
    x = torch.randn(rows, in_dim, generator=gen)
    xb = x.to(torch.bfloat16)
    y, yb = torch.empty(rows, out), torch.empty(rows, out, dtype=torch.bfloat16)  # as a step's
    best = _best(
        {
            "amx": lambda: [bf16_dot.linear(x, p, out=y) for p in paired],
            "fp32-compute": lambda: [bf16_linear.linear(x, t, out=y) for t in tiled],
            "torch-bf16": lambda: [torch.mm(xb, w.t(), out=yb) for w in w_nt],
        },
        reps,
    )
    gb, macs = in_dim * out * 2 * LAYERS / 1e9, rows * in_dim * out * LAYERS / 1e9
    cells = [f"{s * 1e3:8.2f} ms {gb / s:5.1f} GB/s {macs / s:6.1f} GMAC/s" for s in best.values()]
    return f"| {rows:5d} | {name:8s} | " + " | ".join(cells) + " |"


def _head_row(rows: int, reps: int) -> str:
    gen = torch.Generator().manual_seed(rows)
    e = torch.randn(49152, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, 576, generator=gen)
    best = _best(
        {
            "amx": lambda: bf16_dot.linear_nt(x, e),
            "fp32-compute": lambda: bf16_linear.linear_nt(x, e),
            "torch-bf16": lambda: torch.nn.functional.linear(x.to(torch.bfloat16), e),
        },
        reps,
    )
    gb = e.numel() * 2 / 1e9
    cells = [f"{s * 1e3:8.2f} ms {gb / s:5.1f} GB/s" for s in best.values()]
    return f"| {rows:5d} | head     | " + " | ".join(cells) + " |"


def _mlp_row(rows: int, reps: int) -> str:
    """The SwiGLU MLP over 30 layers' weights: three AMX calls, one AMX call, torch bf16."""
    gen = torch.Generator().manual_seed(rows)
    hidden, inter = 576, 1536
    gu = [torch.randn(hidden, 2 * inter, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    dn = [torch.randn(inter, hidden, generator=gen).to(torch.bfloat16) for _ in range(LAYERS)]
    p_gu, p_dn = (
        [PairedWeight.from_weight_t(w) for w in gu],
        [PairedWeight.from_weight_t(w) for w in dn],
    )
    t_gu, t_dn = [w.t().contiguous() for w in gu], [w.t().contiguous() for w in dn]
    x = torch.randn(rows, hidden, generator=gen)
    xb = x.to(torch.bfloat16)
    buf, y = torch.empty(rows, 2 * inter), torch.empty(rows, hidden)

    def three() -> None:
        for g, d in zip(p_gu, p_dn, strict=True):
            bf16_dot.linear(x, g, out=buf)
            torch._C._nn.silu_(buf[:, :inter])
            bf16_dot.linear(buf[:, :inter], d, out=y, up=buf[:, inter:])

    def torch_bf16() -> None:
        for g, d in zip(t_gu, t_dn, strict=True):
            a, b = torch.nn.functional.linear(xb, g).chunk(2, dim=-1)
            torch.nn.functional.linear(torch.nn.functional.silu(a) * b, d)

    best = _best(
        {
            "three": three,
            "one": lambda: [bf16_dot.mlp(x, g, d, out=y) for g, d in zip(p_gu, p_dn, strict=True)],
            "torch-bf16": torch_bf16,
        },
        reps,
    )
    flops = 2 * rows * 3 * hidden * inter * LAYERS / 1e9
    cells = [f"{s * 1e3:8.2f} ms {flops / s:7.1f} GFLOP/s" for s in best.values()]
    return f"| {rows:5d} | " + " | ".join(cells) + f" | {best['three'] / best['one']:.2f}x |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else "")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="rows 1 and 16 only, 3 rounds")
    args = ap.parse_args()
    if not bf16_dot.amx():
        raise SystemExit(f"AMX does not run here: {bf16_dot.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    reps = 3 if args.quick else args.reps
    print(f"threads {args.threads}; per {LAYERS} calls (one per layer); min of {reps} rounds")
    print("| rows | shape | AMX (medium) | fp32-compute (highest) | torch bf16 (oneDNN) |")
    print("|---|---|---|---|---|")
    for rows in (1, 16) if args.quick else (1, 16, 1024):
        for name, (in_dim, out) in SHAPES.items():
            print(_linear_row(name, in_dim, out, rows, max(2, reps // 3 if rows > 16 else reps)))
    for rows in (1, 16):
        print(_head_row(rows, reps))
    if bf16_dot.mlp_ready():
        print("\nSwiGLU MLP, 576 -> 2 x 1536 -> 576, per 30 layers")
        print("| rows | three AMX calls | one call (mlp) | torch bf16 | three / one |")
        print("|---|---|---|---|---|")
        for rows in (16,) if args.quick else (16, 256, 1024):
            print(_mlp_row(rows, max(2, reps // 3 if rows > 16 else reps)))


if __name__ == "__main__":
    main()
