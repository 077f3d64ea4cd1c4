"""Benchmarks of pagedkv.tiers: disk and Redis tier throughput against raw I/O of the same bytes.

Run ``python benchmarks/bench_tiers.py`` (about a minute on 2 cores; it starts its own
``redis-server`` on a free loopback port, or uses ``--redis-url``); ``--quick`` takes a few
seconds; ``--json PATH`` writes every row. Timing is wall clock (I/O waits are the point).

disk-write  ``DiskTier.put`` of N payloads (temp file, rename, index, budget) vs plain
            ``open(path, "wb").write(payload)`` of the same bytes to new files, same folder tree,
            same run; both into the page cache (fsync policy ``none``) unless ``--fsync``.
            Files are deleted and ``os.sync()`` runs between rounds, untimed; the two run
            interleaved, round by round, in alternating order.
disk-read   ``DiskTier.try_get`` (open, read, header + xxh3 checksum, mtime touch) vs plain
            ``open(path, "rb").read()`` of the same files: ``cached`` with the files in the page
            cache (a memory copy: the checksum pass is then a large share), ``cold`` after
            ``posix_fadvise(DONTNEED)`` on every file before each timed pass (device reads).
redis-write ``RedisTier.put_many`` (pipelined EXISTS, then SET NX, bounded batches) vs a raw
            redis-py pipeline of SET of the same values in batches of the same size; FLUSHALL
            between rounds, untimed.
redis-read  ``RedisTier.get_many`` (pipelined GET, verify) vs a raw pipelined GET.
encode      the caller's side of an offload: ``encode`` (xxh3 checksum + one copy of the body) and
            ``OffloadCoordinator.submit`` of N blocks (writer not started: queueing only).
disk-scan   start-up of a ``DiskTier`` over 100,000 block files (index rebuild: scandir, one
            stat per file, sort by mtime), seconds per start-up.

Targets (issue 5): disk and Redis tiers reach at least 0.8 of the raw throughput.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import base_parser, machine_info, selected_fixtures
from pagedkv.tiers import DiskTier, PayloadHeader, TierLayout, encode

TARGET_RATIO = 0.8
MB = 1 << 20


@dataclass(slots=True)
class Row:
    bench: str
    case: str
    impl: str
    gb_per_s: float | None  # throughput (None for the scan row)
    seconds: float  # median seconds per round
    spread: float  # (max - min) / median over rounds
    rounds: int
    best_seconds: float = 0.0  # the fastest round (the least disturbed on a shared machine)
    ratio: float | None = None  # ours / raw throughput, from the medians
    best_ratio: float | None = None  # ours / raw throughput, from the fastest rounds
    note: str = ""

    @property
    def meets_target(self) -> bool | None:
        return None if self.ratio is None else self.ratio >= TARGET_RATIO


def layout_for(payload_mb: float) -> TierLayout:
    """A layout whose block body is ``payload_mb`` MB (fp16, 128-dim heads, 16-token blocks)."""
    per_layer = 2 * 16 * 8 * 128 * 2  # K+V, 16 tokens, 8 KV heads, head dim 128, fp16 = 64 KiB
    return TierLayout("bench", int(payload_mb * MB) // per_layer, 8, 128, 16, "float16")


def make_payloads(layout: TierLayout, n: int) -> list[tuple[bytes, bytes]]:
    base = os.urandom(layout.block_bytes)
    out = []
    for i in range(n):
        h = i.to_bytes(16, "big")
        body = i.to_bytes(8, "little") + base[8:]
        out.append((h, encode(PayloadHeader(layout, h, layout.block_size), body)))
    return out


def measure_pair(
    ours: Callable[[], object],
    raw: Callable[[], object],
    rounds: int,
    reset: Callable[[], object] | None = None,
) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(median s, spread, best s) of ``ours`` and of ``raw``, interleaved round by round (the order
    alternates) so both see the same machine; ``reset`` runs untimed before each timed call."""
    times: dict[str, list[float]] = {"ours": [], "raw": []}
    for i in range(rounds + 1):  # round 0 warms up
        order = (("ours", ours), ("raw", raw)) if i % 2 else (("raw", raw), ("ours", ours))
        for name, fn in order:
            if reset is not None:
                reset()
            t0 = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - t0)

    def summary(ts: list[float]) -> tuple[float, float, float]:
        med = statistics.median(ts)
        return med, (max(ts) - min(ts)) / med, min(ts)

    return summary(times["ours"]), summary(times["raw"])


def measure(fn: Callable[[], object], rounds: int) -> tuple[float, float]:
    """Median seconds and spread of ``fn`` over ``rounds`` after one warm-up call."""
    fn()
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    return med, (max(times) - min(times)) / med


def drop_cache(paths: list[str]) -> None:
    """Evict these files' pages from the page cache (clean pages only; no root needed)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def pair(
    bench: str,
    case: str,
    nbytes: int,
    ours: tuple[float, float, float],
    raw: tuple[float, float, float],
    rounds: int,
) -> list[Row]:
    raw_row = Row(bench, case, "raw", nbytes / raw[0] / 1e9, raw[0], raw[1], rounds, raw[2])
    our_row = Row(bench, case, "pagedkv", nbytes / ours[0] / 1e9, ours[0], ours[1], rounds, ours[2])
    our_row.ratio = raw[0] / ours[0]
    our_row.best_ratio = raw[2] / ours[2]
    return [our_row, raw_row]


# ---------------------------------------------------------------------- disk
def bench_disk(root: Path, payload_mb: float, total_mb: int, rounds: int, fsync: bool) -> list[Row]:
    layout = layout_for(payload_mb)
    n = max(4, int(total_mb / payload_mb))
    items = make_payloads(layout, n)
    nbytes = sum(len(p) for _, p in items)
    tier_root, raw_root = root / "tier", root / "raw"
    policy = "file" if fsync else "none"
    tier = DiskTier(tier_root, layout, 2 * nbytes, fsync=policy)
    raw_paths = [str(raw_root / h.hex()[:2] / h.hex()) for h, _ in items]
    for p in raw_paths:
        os.makedirs(os.path.dirname(p), mode=0o700, exist_ok=True)

    def tier_reset() -> None:
        for h, _ in items:
            tier.delete(h)

    def tier_write() -> None:
        for h, p in items:
            tier.put(h, p)

    def raw_reset() -> None:
        for p in raw_paths:
            if os.path.exists(p):
                os.unlink(p)

    def raw_write() -> None:
        for path, (_, p) in zip(raw_paths, items, strict=True):
            with open(path, "wb") as fh:
                fh.write(p)
                if fsync:
                    fh.flush()
                    os.fsync(fh.fileno())

    def tier_read() -> None:
        for h, _ in items:
            if tier.try_get(h) is None:
                raise RuntimeError("disk tier lost a block during the benchmark")

    def raw_read() -> None:
        for path in raw_paths:
            with open(path, "rb") as fh:
                fh.read()

    case = f"{payload_mb:g} MB x {n}" + (" fsync" if fsync else "")

    def reset_both() -> None:
        tier_reset()
        raw_reset()
        os.sync()  # writeback of the last round stays out of the next one

    def cold() -> None:
        drop_cache(raw_paths + [tier.path_of(h) for h, _ in items])

    w_ours, w_raw = measure_pair(tier_write, raw_write, rounds, reset_both)
    tier_write()
    raw_write()
    r_ours, r_raw = measure_pair(tier_read, raw_read, rounds)
    c_ours, c_raw = measure_pair(tier_read, raw_read, rounds, cold)
    rows = pair("disk-write", case, nbytes, w_ours, w_raw, rounds)
    rows += pair("disk-read", case + " cached", nbytes, r_ours, r_raw, rounds)
    rows += pair("disk-read", case + " cold", nbytes, c_ours, c_raw, rounds)
    if tier.stats().corrupt or tier.stats().dropped_writes:
        raise RuntimeError(f"disk tier misbehaved: {tier.stats()}")
    tier.close()
    shutil.rmtree(tier_root)
    shutil.rmtree(raw_root)
    return rows


def bench_scan(root: Path, num_blocks: int, rounds: int) -> list[Row]:
    layout = TierLayout("scan", 1, 1, 1, 1, "uint8")
    tier = DiskTier(root / "scan", layout, 1 << 40)
    for i in range(num_blocks):
        h = i.to_bytes(16, "big")
        tier.put(h, encode(PayloadHeader(layout, h, 1), b"\0\0"))
    tier.close()
    seen: list[int] = []

    def start() -> None:
        again = DiskTier(root / "scan", layout, 1 << 40)
        seen.append(again.num_blocks)
        again.close()

    med, spread = measure(start, rounds)
    if set(seen) != {num_blocks}:
        raise RuntimeError(f"scan found {seen} blocks, expected {num_blocks}")
    shutil.rmtree(root / "scan")
    note = f"{med / num_blocks * 1e6:.1f} µs per block"
    return [
        Row("disk-scan", f"{num_blocks:,} blocks", "pagedkv", None, med, spread, rounds, note=note)
    ]


def bench_encode(payload_mb: float, total_mb: int, rounds: int) -> list[Row]:
    from pagedkv.tiers import HostTier, OffloadCoordinator

    layout = layout_for(payload_mb)
    n = max(4, int(total_mb / payload_mb))
    body = os.urandom(layout.block_bytes)
    headers = [PayloadHeader(layout, i.to_bytes(16, "big"), layout.block_size) for i in range(n)]

    def enc() -> None:
        for hd in headers:  # each result is dropped at once: no fresh-memory page faults
            encode(hd, body)

    med, spread = measure(enc, rounds)
    nbytes = n * layout.block_bytes
    note = f"{med / n * 1e6:.0f} µs per block"
    case = f"{payload_mb:g} MB x {n}"
    rows = [Row("encode", case, "pagedkv", nbytes / med / 1e9, med, spread, rounds, note=note)]
    payload = encode(headers[0], body)
    items = [(hd.block_hash, payload) for hd in headers]  # submit does not read the payload
    times = []
    for _ in range(rounds):
        off = OffloadCoordinator([HostTier(layout, 1 << 40)], max_queue_blocks=n, start=False)
        t0 = time.perf_counter()
        for hsh, p in items:
            off.submit(hsh, p)
        times.append(time.perf_counter() - t0)
    med = statistics.median(times)
    spread = (max(times) - min(times)) / med
    note = f"{med / n * 1e6:.1f} µs per block"
    rows.append(Row("submit", f"{n} blocks", "pagedkv", None, med, spread, rounds, note=note))
    return rows


# ---------------------------------------------------------------------- redis
@contextmanager
def redis_server(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server not found; install it or pass --redis-url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    folder = tempfile.mkdtemp(prefix="bench-redis-")
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", folder, "--save", "",
            "--appendonly", "no", "--maxmemory", "0"]  # fmt: skip
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(folder, ignore_errors=True)


def bench_redis(url: str, payload_mb: float, total_mb: int, rounds: int) -> list[Row]:
    import redis

    from pagedkv.tiers.redis_tier import RedisTier

    layout = layout_for(payload_mb)
    n = max(4, int(total_mb / payload_mb))
    items = make_payloads(layout, n)
    nbytes = sum(len(p) for _, p in items)
    tier = RedisTier(url, layout, socket_timeout_s=30.0)
    raw = redis.Redis.from_url(url, socket_timeout=30.0)
    keys = [tier.key_of(h) for h, _ in items]
    batch_keys = min(tier.batch_max_keys, max(1, tier.batch_max_bytes // len(items[0][1])))

    def flush() -> None:
        raw.flushall()

    def raw_write() -> None:
        for i in range(0, n, batch_keys):
            pipe = raw.pipeline(transaction=False)
            for k, (_, p) in zip(keys[i : i + batch_keys], items[i : i + batch_keys], strict=True):
                pipe.set(k, p)
            pipe.execute()

    def tier_write() -> None:
        if tier.put_many(items) != n:
            raise RuntimeError("redis tier dropped writes during the benchmark")

    def raw_read() -> None:
        for i in range(0, n, batch_keys):
            pipe = raw.pipeline(transaction=False)
            for k in keys[i : i + batch_keys]:
                pipe.get(k)
            pipe.execute()

    def tier_read() -> None:
        if any(v is None for v in tier.get_many([h for h, _ in items])):
            raise RuntimeError("redis tier missed a block during the benchmark")

    case = f"{payload_mb:g} MB x {n}, batch {batch_keys}"
    w_ours, w_raw = measure_pair(tier_write, raw_write, rounds, flush)
    tier_write()
    r_ours, r_raw = measure_pair(tier_read, raw_read, rounds)
    tier.close()
    raw.flushall()
    raw.close()
    rows = pair("redis-write", case, nbytes, w_ours, w_raw, rounds)
    return rows + pair("redis-read", case, nbytes, r_ours, r_raw, rounds)


# ---------------------------------------------------------------------- output
def print_rows(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="pagedkv tiers: throughput vs raw I/O (wall clock)", title_justify="left")
    cols = ("bench", "case", "impl", "GB/s", "median", "spread", "ours/raw", "best ratio", "note")
    for col in cols:
        table.add_column(
            col, justify="left" if col in ("bench", "case", "impl", "note") else "right"
        )
    for r in rows:
        ratio = ""
        if r.ratio is not None:
            ratio = f"{r.ratio:.2f} " + ("ok" if r.meets_target else "MISS")
        table.add_row(
            r.bench,
            r.case,
            r.impl,
            "" if r.gb_per_s is None else f"{r.gb_per_s:.2f}",
            f"{r.seconds * 1e3:,.1f} ms",
            f"{r.spread:.0%}",
            ratio,
            "" if r.best_ratio is None else f"{r.best_ratio:.2f}",
            r.note,
        )
    console = Console(width=max(140, Console().width))
    console.print(table)
    console.print(f"target: ours/raw >= {TARGET_RATIO} (issue 5)")


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--redis-url", help="use this server instead of starting redis-server")
    parser.add_argument("--dir", help="folder for the disk benchmarks (default: a temp folder)")
    parser.add_argument("--fsync", action="store_true", help="also run disk rows with fsync")
    parser.add_argument("--scan-blocks", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, help="timed rounds per row (default 5, quick 3)")
    parser.add_argument("--total-mb", type=int, help="MB per disk row (default 256, quick 32)")
    args = parser.parse_args(argv)
    fixtures = ("disk", "encode", "scan", "redis")
    only = selected_fixtures(parser, args, fixtures)
    quick = args.quick
    rounds = args.rounds or (3 if quick else 5)
    total_mb = args.total_mb or (32 if quick else 256)
    rows: list[Row] = []
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="bench-tiers-"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        if "disk" in only:
            for mb in (0.5, 2.0):
                rows += bench_disk(base, mb, total_mb, rounds, fsync=False)
                if args.fsync:
                    rows += bench_disk(base, mb, total_mb // 4, rounds, fsync=True)
        if "encode" in only:
            for mb in (0.5, 2.0):
                rows += bench_encode(mb, total_mb, rounds)
        if "scan" in only:
            rows += bench_scan(base, min(5_000, args.scan_blocks) if quick else args.scan_blocks, 3)
        if "redis" in only:
            with redis_server(args.redis_url) as url:
                for mb in (0.5, 2.0):
                    rows += bench_redis(url, mb, total_mb // 2, rounds)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    print_rows(rows)
    if args.json:
        import json

        doc: dict[str, Any] = {
            "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "machine": machine_info(),
            "target_ratio": TARGET_RATIO,
            "results": [asdict(r) | {"meets_target": r.meets_target} for r in rows],
        }
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
