"""Benchmarks of pagedkv.core: admission checks, allocate/free, cached-prefix hits, hashing.

Run ``python benchmarks/bench_core.py`` (about 15 s on 2 cores; 2 minutes with both peers) or
``pagedkv bench-core``; ``--quick`` takes 2 s; ``--json PATH`` writes every row;
``--peer-vllm PATH`` and ``--peer-infinilm PATH`` run the same fixtures on a peer's extracted
source tree in this process and print ratios (peer time / pagedkv time). Fixtures (numbers and
how to get the peers' trees: benchmarks/RESULTS.md):

admission  InfiniLM's capacity-check fixture. Block size 16. Running requests (16 prompt tokens,
           max_tokens=128, 64 tokens generated one decode step at a time: 5 blocks each, 4 more
           claimed) are built through the manager API; filler requests then take every remaining
           page (prefilled and committed, so their blocks are hashed); then whole fillers are
           freed until half the pages are free again. Those pages stay cached (ref 0, hashed, in
           the LRU), so free capacity includes evictable blocks. The candidate has 128 prompt
           tokens (its first 64 hit a released filler: 4 evictable hit blocks) and
           max_tokens=128; its prefix match runs once beforehand. Timed: 32 ``can_admit`` calls
           per group, median of 5 rounds of 5 groups after 5 warm-up groups.
alloc      ``BlockPool.allocate(n)`` + ``free`` of the same blocks, per block, on an idle pool.
evict      ``BlockPool.allocate(n)`` when every free block is cached (each one is evicted), per
           block; the blocks are re-cached and freed untimed between calls. ``copies``: half
           the pool is indexed and held, and every free block is a freed copy of one of those
           hashes (the eviction drops its copy entry, where pagedkv's free used to: the cost
           the copies free no longer pays is paid here; vLLM pops its duplicate from its map).
prefix     ``match_prefix`` + ``allocate_slots`` of a prompt whose every full block is cached-free
           (a finished request computed it); ``add_request`` (hashing) before the timer, ``free``
           after it.
hash       ``BlockHashChain.extend`` over a 32K-token prompt given as a Python list, per block.
free       ``KVCacheManager.free`` of a finished 256/1K/4K/32K-token request (16 to 2,048 blocks:
           the short ones show the fixed cost), per prompt, admission
           untimed: ``cached`` (it hit every full block; every block goes back to the LRU),
           ``shared`` (another request holds the same blocks: ref 2 -> 1), ``nested`` (a third
           holds the first half too: 3 -> 2, 2 -> 1), ``copies`` (its blocks duplicate a live
           request's). Details and what is like for like with vLLM:
           ``core_free.py``.
touch      the references a prefix hit takes on a cached 4K/32K prompt's blocks, per prompt:
           ``cached-free`` (0 -> 1, off the LRU) and ``in-use`` (1 -> 2), through
           ``touch_owned`` (the manager's call) and the public checked ``touch``: ``core_touch.py``.
counts     ``pool.num_free_blocks`` and ``pool.usage`` (plain attribute reads), per read, on a
           131,072-block pool half in use.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    Case,
    Result,
    add_ratios,
    base_parser,
    flatness,
    print_table,
    run_cases,
    selected_fixtures,
    set_clock,
    write_json,
)
from core_free import FREE_KINDS, free_case
from core_touch import TOUCH_KINDS, touch_case
from pagedkv.core import (
    BlockHashChain,
    BlockPool,
    CacheConfig,
    HashAlgo,
    HashContext,
    KVCacheManager,
    PoolConfig,
)

BLOCK_SIZE = 16
VOCAB = 32_000
RUNNING_PROMPT_TOKENS = 16
RUNNING_MAX_TOKENS = 128
RUNNING_GENERATED = 64
CANDIDATE_PROMPT_TOKENS = 128
CANDIDATE_MAX_TOKENS = 128
CHECKS_PER_GROUP = 32
FILLER_BLOCKS = 64

TARGET_ADMIT_US = 2.0
TARGET_ALLOC_US = 0.4
TARGET_HASH_US = 0.6
ADMIT_FLAT = 1.25

FIXTURES = ("admission", "alloc", "evict", "prefix", "hash", "free", "touch", "counts")
ADMISSION_PAGES = (512, 8192, 32_768, 131_072)  # the first two in --quick
ADMISSION_RUNNING = (32, 1024)  # the first in --quick
ALLOC_POOL_SIZES = (1024, 131_072, 16_384, 1_048_576)  # the first two in --quick
ALLOC_BATCHES = (1, 64)
PREFIX_LENGTHS = (4096, 32_768)
FREE_LENGTHS = (256, 1024, *PREFIX_LENGTHS)  # 16 and 64 blocks: short requests (fixed cost)
HASH_TOKENS, HASH_TOKENS_QUICK = 32_768, 4096


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


# ---------------------------------------------------------------------------- admission
def build_admission_state(
    num_pages: int, num_running: int, seed: int = 0
) -> tuple[KVCacheManager, str, dict[str, Any]]:
    """The InfiniLM admission fixture built through the public manager API (see module doc)."""
    rng = random.Random(seed)
    m = KVCacheManager(CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_pages))
    cap = m.pool.capacity_blocks
    per_running = -(-(RUNNING_PROMPT_TOKENS + RUNNING_GENERATED) // BLOCK_SIZE)
    if num_running * per_running > cap:
        raise ValueError(
            f"{num_running} running requests x {per_running} blocks exceed {cap} pages"
        )
    for i in range(num_running):
        rid = f"run{i}"
        m.add_request(rid, _tokens(rng, RUNNING_PROMPT_TOKENS), max_tokens=RUNNING_MAX_TOKENS)
        m.allocate_slots(rid, RUNNING_PROMPT_TOKENS)
        m.commit(rid, RUNNING_PROMPT_TOKENS)
        for _ in range(RUNNING_GENERATED):  # one decode step per generated token
            m.append_tokens(rid, [rng.randrange(VOCAB)])
            m.allocate_slots(rid, 1)
            m.commit(rid, 1)
    fillers: list[tuple[str, list[int]]] = []
    while m.pool.num_free_blocks:
        n = min(FILLER_BLOCKS, m.pool.num_free_blocks)
        rid, toks = f"fill{len(fillers)}", _tokens(rng, n * BLOCK_SIZE)
        m.add_request(rid, toks)
        m.allocate_slots(rid, len(toks))
        m.commit(rid, len(toks))
        fillers.append((rid, toks))
    all_allocated = m.pool.num_free_blocks == 0
    released: list[list[int]] = []
    while fillers and m.pool.num_free_blocks < cap // 2:
        rid, toks = fillers.pop()
        m.free(rid)
        released.append(toks)
    cand = "candidate"
    shared = released[0][:64] if released else []
    m.add_request(
        cand,
        shared + _tokens(rng, CANDIDATE_PROMPT_TOKENS - len(shared)),
        max_tokens=CANDIDATE_MAX_TOKENS,
    )
    match = m.match_prefix(cand)  # once beforehand, as InfiniLM does
    m.check_invariants()
    info = {
        "pages": num_pages,
        "running": num_running,
        "all_allocated_first": all_allocated,
        "free_fraction": m.pool.num_free_blocks / cap,
        "cached_free_blocks": m.pool.num_cached_free_blocks,
        "running_claim_blocks": m.running_claim_blocks,
        "candidate_hit_blocks": len(match.block_ids),
        "admits": m.can_admit(cand),
    }
    return m, cand, info


def admission_cases(quick: bool) -> list[Case]:
    sizes = ADMISSION_PAGES[:2] if quick else ADMISSION_PAGES
    runnings = ADMISSION_RUNNING[:1] if quick else ADMISSION_RUNNING
    cases: list[Case] = []
    for running in runnings:
        for pages in sizes:
            try:
                m, cand, info = build_admission_state(pages, running)
            except ValueError as exc:
                print(f"admission pages={pages} running={running}: skipped ({exc})")
                continue

            def group(can_admit: Callable[[str], bool] = m.can_admit, cand: str = cand) -> None:
                for _ in range(CHECKS_PER_GROUP):
                    can_admit(cand)

            cases.append(
                Case(
                    "admission",
                    f"pages={pages:,} running={running:,}",
                    "pagedkv",
                    "check",
                    group,
                    ops=CHECKS_PER_GROUP,
                    calls_per_round=5,  # 5 rounds of 5 groups after 5 warm-up groups
                    rounds=5,
                    warmup=5,
                    target_us=TARGET_ADMIT_US,
                    params=info,
                    note=f"free {info['free_fraction']:.0%}, admits={info['admits']}",
                    interleave="admission",  # every size alike under load
                )
            )
    return cases


# ---------------------------------------------------------------------------- pool
def alloc_cases(quick: bool) -> list[Case]:
    cases: list[Case] = []
    for num_blocks in sorted(ALLOC_POOL_SIZES[:2] if quick else ALLOC_POOL_SIZES):
        for batch in ALLOC_BATCHES:
            pool = BlockPool(PoolConfig(num_blocks=num_blocks))

            def group(
                allocate: Callable[[int], list[int]] = pool.allocate,
                free: Callable[[list[int]], None] = pool.free,
                batch: int = batch,
            ) -> None:
                free(allocate(batch))

            cases.append(
                Case(
                    "alloc+free",
                    f"pool={num_blocks:,} batch={batch}",
                    "pagedkv",
                    "block",
                    group,
                    ops=batch,
                    calls_per_round=max(1, 640 // batch),
                    target_us=TARGET_ALLOC_US if batch > 1 else None,
                    params={"pool_blocks": num_blocks, "batch": batch},
                    check=pool.check_invariants,
                )
            )
    return cases


def evict_cases(quick: bool) -> list[Case]:
    cases: list[Case] = []
    for num_blocks in (1024,) if quick else (1024, 16_384, 131_072):
        pool = BlockPool(PoolConfig(num_blocks=num_blocks))
        counter = [0]

        def cache_and_free(ids: list[int], pool: BlockPool = pool, c: list[int] = counter) -> None:
            hashes = [(c[0] + i).to_bytes(16, "little") for i in range(len(ids))]
            c[0] += len(ids)
            pool.cache_blocks(ids, hashes, parent_hash=None)
            pool.free(ids[::-1])

        cache_and_free(pool.allocate(pool.num_free_blocks))  # every free block is cached

        def check(pool: BlockPool = pool) -> None:
            pool.check_invariants()
            if pool.num_cached_free_blocks != pool.capacity_blocks:
                raise RuntimeError("evict fixture: a free block was left uncached")

        cases.append(_evict_case("", pool, cache_and_free, check, quick))
    return cases


def _evict_case(
    kind: str,
    pool: BlockPool,
    refill: Callable[[list[int]], None],
    check: Callable[[], None],
    quick: bool,
) -> Case:
    """A row of ``evict``: ``allocate(64)`` timed, ``refill`` of those blocks untimed after."""
    batch = 64
    held: list[list[int]] = []
    params: dict[str, Any] = {"pool_blocks": pool.num_blocks, "batch": batch}
    return Case(
        "evict",
        f"{kind + ' ' if kind else ''}pool={pool.num_blocks:,} batch={batch}",
        "pagedkv",
        "block",
        lambda: held.append(pool.allocate(batch)),
        ops=batch,
        teardown=lambda: refill(held.pop()),
        rounds=9 if quick else 41,
        warmup=3,
        params={**params, "kind": kind} if kind else params,
        check=check,
    )


def evict_copy_cases(quick: bool) -> list[Case]:
    """The ``copies`` rows of ``evict``: every free block a freed copy (see the docstring)."""
    cases: list[Case] = []
    for num_blocks in (1024,) if quick else (1024, 16_384, 131_072):
        pool = BlockPool(PoolConfig(num_blocks=num_blocks))
        half = pool.capacity_blocks // 2
        canon = pool.allocate(half)  # held for the whole run: they serve every hash
        pool.cache_blocks(canon, [copy_hash(b, half) for b in canon], parent_hash=None)

        def copy_and_free(ids: list[int], pool: BlockPool = pool, half: int = half) -> None:
            pool.cache_blocks(ids, [copy_hash(b, half) for b in ids], parent_hash=None)
            pool.free(ids[::-1])

        copy_and_free(pool.allocate(pool.num_free_blocks))  # every free block a freed copy

        def check(pool: BlockPool = pool, half: int = half) -> None:
            pool.check_invariants()
            if pool.num_copy_blocks != pool.capacity_blocks - half:
                raise RuntimeError("evict fixture (copies): a free block is not a copy")

        cases.append(_evict_case("copies", pool, copy_and_free, check, quick))
    return cases


def copy_hash(block_id: int, half: int) -> bytes:
    """The hash a block of the evict-copies fixture holds: block ids ``b`` and ``b + half``
    share one, so each free copy duplicates a distinct held block."""
    return ((block_id - 1) % half).to_bytes(32, "little")


# ---------------------------------------------------------------------------- prefix hit
def prefix_prompt(num_tokens: int, seed: int = 1) -> list[int]:
    return _tokens(random.Random(seed), num_tokens)


def prefix_cases(quick: bool) -> list[Case]:
    cases: list[Case] = []
    for num_tokens in PREFIX_LENGTHS[:1] if quick else PREFIX_LENGTHS:
        prompt = prefix_prompt(num_tokens)
        m = KVCacheManager(
            CacheConfig(block_size=BLOCK_SIZE, num_blocks=2 * num_tokens // BLOCK_SIZE + 64)
        )
        m.add_request("warm", prompt)
        m.allocate_slots("warm", num_tokens)
        m.commit("warm", num_tokens)
        m.free("warm")  # every full block is now cached-free
        state: dict[str, Any] = {"n": 0}

        def setup(m: KVCacheManager = m, st: dict[str, Any] = state, p: list[int] = prompt) -> None:
            st["n"] += 1
            st["rid"] = f"r{st['n']}"
            m.add_request(st["rid"], p)  # hashes computed here, untimed

        def op(m: KVCacheManager = m, st: dict[str, Any] = state, n: int = num_tokens) -> None:
            st["hit"] = m.match_prefix(st["rid"]).num_cached_tokens
            m.allocate_slots(st["rid"], n - st["hit"])

        def check(m: KVCacheManager = m, st: dict[str, Any] = state, n: int = num_tokens) -> None:
            m.check_invariants()
            if st["hit"] != (n - 1) // BLOCK_SIZE * BLOCK_SIZE:
                raise RuntimeError(f"prefix fixture hit {st['hit']} tokens, not a full hit")

        cases.append(
            Case(
                "prefix",
                f"cached prompt={num_tokens:,} tokens",
                "pagedkv",
                "prompt",
                op,
                setup=setup,
                teardown=lambda m=m, st=state: m.free(st["rid"]),
                rounds=5 if quick else 21,
                warmup=2,
                params={"prompt_tokens": num_tokens},
                check=check,
            )
        )
    return cases


# ---------------------------------------------------------------------------- hashing
def hash_cases(quick: bool) -> list[Case]:
    num_tokens = HASH_TOKENS_QUICK if quick else HASH_TOKENS
    prompt = prefix_prompt(num_tokens, seed=2)
    cases: list[Case] = []
    for algo in (HashAlgo.XXH3_128, HashAlgo.SHA256):
        ctx = HashContext(algo=algo)
        chains: list[BlockHashChain] = []
        cases.append(
            Case(
                "hash",
                f"{algo.value}, {num_tokens:,}-token prompt",
                "pagedkv",
                "block",
                lambda chains=chains, prompt=prompt: chains[-1].extend(prompt),
                ops=num_tokens // BLOCK_SIZE,
                setup=lambda chains=chains, ctx=ctx: chains.append(BlockHashChain(BLOCK_SIZE, ctx)),
                teardown=chains.clear,
                rounds=5 if quick else 11,
                warmup=2,
                target_us=TARGET_HASH_US if algo is HashAlgo.XXH3_128 else None,
                params={"algo": algo.value, "prompt_tokens": num_tokens},
            )
        )
    return cases


# ---------------------------------------------------------------------------- free, counts
def free_cases(quick: bool) -> list[Case]:
    """``KVCacheManager.free``: cached, shared, nested and copies (``core_free.py``)."""
    return [
        free_case(kind, prefix_prompt(n), BLOCK_SIZE, quick)
        for n in (FREE_LENGTHS[:1] if quick else FREE_LENGTHS)
        for kind in FREE_KINDS
    ]


def touch_cases(quick: bool) -> list[Case]:
    """``BlockPool.touch_owned`` and ``touch`` of a cached prompt's blocks (``core_touch.py``)."""
    return [
        touch_case(kind, n, BLOCK_SIZE, quick, checked=checked)
        for n in (PREFIX_LENGTHS[:1] if quick else PREFIX_LENGTHS)
        for kind in TOUCH_KINDS
        for checked in (False, True)
    ]


def count_cases(quick: bool) -> list[Case]:
    pool = BlockPool(PoolConfig(num_blocks=131_072))
    pool.allocate(65_536)
    return [
        Case(
            "counts",
            f"pool.{name}, pool=131,072",
            "pagedkv",
            "read",
            fn,
            calls_per_round=10_000,
            rounds=5 if quick else 11,
            params={"query": name},
        )
        for name, fn in (
            ("num_free_blocks", lambda p=pool: p.num_free_blocks),
            ("usage", lambda p=pool: p.usage),
        )
    ]


# ---------------------------------------------------------------------------- main
def _footer(results: list[Result]) -> list[str]:
    """Flatness lines: max/min of pagedkv's medians across sizes (the O(1) claims)."""
    lines: list[str] = []
    adm = [r for r in results if r.bench == "admission" and r.impl == "pagedkv"]
    for running in sorted({r.params["running"] for r in adm}):
        rows = [r for r in adm if r.params["running"] == running]
        if len(rows) > 1:
            f = flatness(rows)
            ok = "ok" if f <= ADMIT_FLAT else "MISS"
            lines.append(
                f"admission, running={running:,}: max/min across pool sizes = {f:.2f} "
                f"(target <= {ADMIT_FLAT}) {ok}"
            )
    for pages in sorted({r.params["pages"] for r in adm}):
        rows = [r for r in adm if r.params["pages"] == pages]
        if len(rows) > 1:
            f = flatness(rows)
            ok = "ok" if f <= ADMIT_FLAT else "MISS"
            lines.append(
                f"admission, pages={pages:,}: max/min across running counts = {f:.2f} "
                f"(target <= {ADMIT_FLAT}) {ok}"
            )
    if len(adm) > 1:
        f = flatness(adm)
        ok = "ok" if f <= ADMIT_FLAT else "MISS"
        lines.append(f"admission, all cases: max/min = {f:.2f} (target <= {ADMIT_FLAT}) {ok}")
    alloc = [r for r in results if r.bench == "alloc+free" and r.impl == "pagedkv"]
    for batch in sorted({r.params["batch"] for r in alloc}):
        rows = [r for r in alloc if r.params["batch"] == batch]
        if len(rows) > 1:
            lines.append(
                f"alloc+free batch={batch}: max/min across pool sizes = {flatness(rows):.2f}"
            )
    for r in results:
        if r.bench == "prefix" and r.impl == "vllm" and r.ratio is not None:
            ok = "ok" if r.ratio >= 2 else "MISS"
            lines.append(
                f"prefix {r.case}: pagedkv takes {1 / r.ratio:.0%} of vLLM's time "
                f"(target <= 50%) {ok}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--peer-vllm", metavar="PATH", help="an extracted vLLM source tree")
    parser.add_argument(
        "--peer-infinilm", metavar="PATH", help="an InfiniLM checkout (python/infinilm/llm)"
    )
    args = parser.parse_args(argv)
    set_clock(args.clock)
    only = selected_fixtures(parser, args, FIXTURES)
    ours: dict[str, Callable[[bool], list[Case]]] = {
        "admission": admission_cases,
        "alloc": alloc_cases,
        "evict": lambda quick: evict_cases(quick) + evict_copy_cases(quick),
        "prefix": prefix_cases,
        "hash": hash_cases,
        "free": free_cases,
        "touch": touch_cases,
        "counts": count_cases,
    }
    peers = []
    for name, path in (("vllm", args.peer_vllm), ("infinilm", args.peer_infinilm)):
        if path is not None:
            from peers import load_peer

            try:
                peers.append(load_peer(name, path))
            except (ImportError, OSError) as exc:
                print(f"peer {name} at {path}: cannot load ({type(exc).__name__}: {exc})")
                return 2
    results: list[Result] = []
    for fixture in FIXTURES:
        if fixture not in only:
            continue
        cases = ours[fixture](args.quick)
        for peer in peers:
            cases += peer.cases(fixture, args.quick)
        results += run_cases(cases)  # built and timed one fixture at a time (memory)
    add_ratios(results)
    first_row: dict[tuple[str, str], int] = {}
    for i, r in enumerate(results):
        first_row.setdefault((r.bench, r.case), i)
    # Each peer row right under the pagedkv row of the same case.
    results.sort(key=lambda r: first_row[(r.bench, r.case)])
    print_table("pagedkv.core benchmarks (time per operation)", results, _footer(results))
    if args.json:
        write_json(args.json, results)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
