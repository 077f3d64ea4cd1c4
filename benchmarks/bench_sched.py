"""Benchmarks of pagedkv.sched: the cost of one scheduler step, and admission against a long queue.

Run ``python benchmarks/bench_sched.py`` (about a minute on 2 cores); ``--quick`` takes a few
seconds; ``--json PATH`` writes every row; ``--peer-infinilm PATH`` runs the decode fixture on
InfiniLM's ``Scheduler`` too, interleaved, and prints ratios (peer time / pagedkv time).
Fixtures (see benchmarks/RESULTS.md for numbers):

decode   N running requests (N = 64, 256, 1,024; 128-token random prompts, max_tokens=1,024, no
         stop tokens, block size 16, a pool with room for every reservation) are prefilled
         through the scheduler until every one decodes; then one step = ``schedule()`` +
         ``update()`` with one sampled token per request (the sampled dict is built once,
         untimed). Every 16th step of a request allocates a block and commits (hashes) a full
         one; a round is a multiple of 16 steps (32 at 64 running, 16 above), so every round
         holds that work equally. The sizes (and the peer's) run round by round, 15 rounds.
         Reported per step and per running request; target: under 5 µs per running request per
         step. The footer gives the growth per request-step from the smallest to the largest
         size: the median of the rounds' ratios and their range (flat: 1.0).
waiting  64 running decodes plus a waiting queue of Q requests (Q = 1, 100, 10,000; 128-token
         prompts) that cannot be admitted, in two ways: ``seqs`` (max_num_seqs = 64 is reached)
         and ``pool`` (max_num_seqs is large, but the running requests' reservations fill the
         pool, so the head fails the O(1) ``can_admit`` check every step). One step =
         ``schedule()`` + ``update()``; target: flat in Q (max/min of the medians <= 1.25).
         The note gives the median wall time of the admission phase alone (``StepStats``).

blocked  The unfavourable admission path: 64 decoding requests whose reservations fill the pool
         and, at the head of the queue, a request whose whole 32K-token prompt is cached-free
         (a finished request computed it) but that cannot be admitted (its evictable hit blocks
         count against free capacity). One step = ``schedule()`` + ``update()``; the note gives
         the admission phase alone: with the exact memo it stays O(1) per step instead of
         re-matching 2,047 blocks.
burst    8 requests sharing a 1,024-token prefix, each with its own 64-token tail, arrive
         together (budget 8,192 tokens, block size 16): steps until every one has its first
         token, timed per step; the note gives the prompt tokens computed (1,536 when the
         shared prefix is computed once; 8,704 when each request computes it).

Invariant checking is off (as in production); the tests run it after every step.
"""

from __future__ import annotations

import random
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import (
    Case,
    Result,
    Timing,
    add_ratios,
    base_parser,
    flatness,
    print_table,
    run_cases,
    selected_fixtures,
    set_clock,
    write_json,
)
from pagedkv.core import CacheConfig
from pagedkv.sched import Request, Scheduler, SchedulerConfig

BLOCK_SIZE = 16
VOCAB = 32_000
PROMPT_TOKENS = 128
MAX_TOKENS = 1024
TARGET_PER_REQUEST_US = 5.0
WAITING_FLAT = 1.25

FIXTURES = ("decode", "waiting", "blocked", "burst")
BLOCKED_HEAD_TOKENS = 32_768
BURST_REQUESTS, BURST_PREFIX, BURST_TAIL = 8, 1024, 64
PREFILL_TOKENS: dict[str, int] = {}  # burst case -> prompt tokens computed
DECODE_SIZES = (64, 256, 1024)  # the first two in --quick
DECODE_ROUNDS = 15  # interleaved round by round over the sizes (and the peer's); 3 in --quick
WAITING_LENGTHS = (1, 100, 10_000)  # 1 and 1,000 in --quick
WAITING_RUNNING = 64
ADMISSION_US: dict[str, float] = {}  # waiting case -> median admission time per step (wall)


def _prompt(rng: random.Random) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]


def build_decoding(
    num_running: int,
    *,
    max_num_seqs: int,
    num_blocks: int,
    seed: int = 0,
    max_model_len: int = PROMPT_TOKENS + MAX_TOKENS + 1,
) -> Scheduler:
    """A scheduler whose ``num_running`` requests have all finished prefill and decode."""
    rng = random.Random(seed)
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=max(8192, num_running),
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            check_invariants=False,
        ),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=num_blocks, watermark=0.0),
    )
    for i in range(num_running):
        sched.add_request(Request(f"run{i}", _prompt(rng), max_tokens=MAX_TOKENS))
    while any(r.num_output_tokens == 0 for r in sched.running) or sched.num_waiting:
        out = sched.schedule()
        if out.is_empty:
            raise RuntimeError("the pool cannot hold every running request")
        sched.update(out, {sr.request_id: [1] for sr in out.scheduled if sr.samples})
    if sched.num_running != num_running:
        raise RuntimeError(f"{sched.num_running} running, wanted {num_running}")
    return sched


def _blocks_for(num_running: int) -> int:
    per_request = -(-(PROMPT_TOKENS + MAX_TOKENS) // BLOCK_SIZE)
    return num_running * per_request + 1


def decode_steps(num_running: int) -> int:
    """Steps per round of the decode fixture: about 2,000 request-steps, and a multiple of the
    block size. Every request started together, so all of them cross into a new block (allocate
    and commit) on the same step, one step in ``BLOCK_SIZE``: a round of a multiple of it holds
    that work exactly as often as every other round (4 steps at 1,024 running did so in one
    round of four, the rounds' spread)."""
    return BLOCK_SIZE * max(1, -(-2048 // (num_running * BLOCK_SIZE)))


def _step_fn(sched: Scheduler) -> tuple[Callable[[], None], Callable[[], None]]:
    """One step, and a check that it really was an all-decode step with no preemption."""
    sampled = {r.request_id: [7] for r in sched.running}
    n = len(sampled)
    schedule, update = sched.schedule, sched.update

    def step() -> None:
        update(schedule(), sampled)

    def check() -> None:
        out = schedule()
        if out.num_scheduled_tokens != n or out.preempted_ids or sched.num_running != n:
            raise RuntimeError(
                f"not a steady decode step: {out.num_scheduled_tokens} tokens for {n} requests, "
                f"{len(out.preempted_ids)} preempted"
            )
        if any(sr.is_prefill for sr in out.scheduled):
            raise RuntimeError("a prefill chunk in a decode step")
        update(out, sampled)

    return step, check


def decode_cases(quick: bool) -> list[Case]:
    cases: list[Case] = []
    for n in DECODE_SIZES[:2] if quick else DECODE_SIZES:
        sched = build_decoding(n, max_num_seqs=n, num_blocks=_blocks_for(n))
        step, check = _step_fn(sched)
        steps = decode_steps(n)
        cases.append(
            Case(
                "decode",
                f"running={n:,}",
                "pagedkv",
                "step",
                step,
                calls_per_round=steps,
                rounds=3 if quick else DECODE_ROUNDS,
                warmup=steps,
                params={"running": n, "prompt_tokens": PROMPT_TOKENS, "steps_per_round": steps},
                check=check,
                interleave="decode",  # every size (and the peer's) round by round: flatness
            )
        )
    return cases


def build_waiting(mode: str, queue_len: int, seed: int = 1) -> Scheduler:
    """64 decoding requests and ``queue_len`` waiting ones that cannot be admitted."""
    n = WAITING_RUNNING
    if mode == "seqs":  # the pool has room; max_num_seqs stops admission
        sched = build_decoding(n, max_num_seqs=n, num_blocks=_blocks_for(n) * 2)
    else:  # reservations fill the pool exactly; the head fails can_admit every step
        sched = build_decoding(n, max_num_seqs=8192, num_blocks=_blocks_for(n))
    rng = random.Random(seed)
    for i in range(queue_len):
        sched.add_request(Request(f"wait{i}", _prompt(rng), max_tokens=MAX_TOKENS))
    return sched


def waiting_cases(quick: bool) -> list[Case]:
    cases: list[Case] = []
    lengths = (1, 1000) if quick else WAITING_LENGTHS
    for mode in ("seqs", "pool"):
        for q in lengths:
            sched = build_waiting(mode, q)
            step, check = _step_fn(sched)

            case_name = f"blocked by {mode}, queue={q:,}"

            def check_waiting(
                check: Callable[[], None] = check, sched: Scheduler = sched, name: str = case_name
            ) -> None:
                admission_s: list[float] = []
                for _ in range(21):
                    check()
                    last = sched.stats().last_step
                    if last.num_admitted:
                        raise RuntimeError("a waiting request was admitted")
                    admission_s.append(last.admission_s)
                ADMISSION_US[name] = statistics.median(admission_s) * 1e6

            cases.append(
                Case(
                    "waiting",
                    case_name,
                    "pagedkv",
                    "step",
                    step,
                    calls_per_round=32,
                    rounds=3 if quick else 7,
                    warmup=32,
                    params={"mode": mode, "queue": q, "running": WAITING_RUNNING},
                    check=check_waiting,
                    interleave=f"waiting-{mode}",  # every queue length alike under load
                )
            )
    return cases


def build_blocked(seed: int = 3) -> Scheduler:
    """64 decodes filling the pool with reservations and a fully cached 32K-token head."""
    n = WAITING_RUNNING
    head_blocks = BLOCKED_HEAD_TOKENS // BLOCK_SIZE
    sched = build_decoding(
        n,
        max_num_seqs=8192,
        num_blocks=_blocks_for(n) + head_blocks,
        max_model_len=BLOCKED_HEAD_TOKENS + 64,
    )
    mgr = sched.manager
    rng = random.Random(seed)
    head = [rng.randrange(VOCAB) for _ in range(BLOCKED_HEAD_TOKENS)]
    mgr.add_request("warm", head)  # computed once, outside the scheduler, then freed
    mgr.allocate_slots("warm", len(head))
    mgr.commit("warm", len(head))
    mgr.free("warm")
    sched.add_request(Request("head", head, max_tokens=16))
    return sched


def blocked_cases(quick: bool) -> list[Case]:
    sched = build_blocked()
    step, check = _step_fn(sched)
    name = f"cached {BLOCKED_HEAD_TOKENS:,}-token head, 64 decodes"

    def check_blocked(check: Callable[[], None] = check, sched: Scheduler = sched) -> None:
        admission_s: list[float] = []
        for _ in range(21):
            check()
            last = sched.stats().last_step
            if last.num_admitted:
                raise RuntimeError("the blocked head was admitted")
            admission_s.append(last.admission_s)
        if sched.manager.match_prefix("head").num_cached_tokens < BLOCKED_HEAD_TOKENS - 16:
            raise RuntimeError("the head's prompt is not cached")
        ADMISSION_US[name] = statistics.median(admission_s) * 1e6

    return [
        Case(
            "blocked",
            name,
            "pagedkv",
            "step",
            step,
            calls_per_round=32,
            rounds=3 if quick else 7,
            warmup=32,
            params={"head_tokens": BLOCKED_HEAD_TOKENS, "running": WAITING_RUNNING},
            check=check_blocked,
        )
    ]


def _burst_scheduler() -> Scheduler:
    rng = random.Random(5)
    prefix = [rng.randrange(VOCAB) for _ in range(BURST_PREFIX)]
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=64, max_model_len=4096),
        CacheConfig(block_size=BLOCK_SIZE, num_blocks=1024, watermark=0.0),
    )
    for i in range(BURST_REQUESTS):
        tail = [rng.randrange(VOCAB) for _ in range(BURST_TAIL)]
        sched.add_request(Request(f"b{i}", prefix + tail, max_tokens=4))
    return sched


def burst_cases(quick: bool) -> list[Case]:
    state: dict[str, Any] = {}
    name = f"{BURST_REQUESTS} x ({BURST_PREFIX:,} shared + {BURST_TAIL}) tokens"

    def setup(st: dict[str, Any] = state) -> None:
        st["sched"] = _burst_scheduler()

    def op(st: dict[str, Any] = state) -> None:
        sched: Scheduler = st["sched"]
        computed = steps = 0
        while any(r.num_output_tokens == 0 for r in sched.requests.values()):
            out = sched.schedule()
            computed += sum(sr.num_tokens for sr in out.scheduled if sr.is_prefill)
            sched.update(out, {sr.request_id: [1] for sr in out.scheduled if sr.samples})
            steps += 1
        st["computed"], st["steps"] = computed, steps

    def check(st: dict[str, Any] = state) -> None:
        PREFILL_TOKENS[name] = st["computed"]
        if st["computed"] != BURST_PREFIX + BURST_REQUESTS * BURST_TAIL:
            raise RuntimeError(f"the burst computed {st['computed']} prompt tokens")

    return [
        Case(
            "burst",
            name,
            "pagedkv",
            "burst",
            op,
            setup=setup,
            rounds=3 if quick else 11,
            warmup=1,
            params={"requests": BURST_REQUESTS, "prefix": BURST_PREFIX, "tail": BURST_TAIL},
            check=check,
        )
    ]


def per_request_rows(results: list[Result]) -> list[Result]:
    """The decode rows again, divided by the number of running requests."""
    rows: list[Result] = []
    for r in results:
        if r.bench != "decode":
            continue
        n = int(r.params["running"])
        t = r.timing
        scaled = Timing(
            tuple(x / n for x in t.cpu_per_op_s),
            tuple(x / n for x in t.wall_per_op_s),
            t.ops_per_round * n,
            t.clock,
        )
        rows.append(
            Result(
                "decode",
                r.case,
                r.impl,
                "request-step",
                scaled,
                TARGET_PER_REQUEST_US,
                r.params,
                f"{r.median_us:,.0f} µs per step",
            )
        )
    return rows


def decode_growth(results: list[Result], impl: str) -> tuple[float, float, float] | None:
    """Per request-step, the largest size's time over the smallest's: the median of the
    rounds' ratios and their range. The sizes run round by round (one ``interleave`` key), so
    round r of each saw the same moment of the machine's load: the ratio is taken per round."""
    rows = {
        int(r.params["running"]): r.timing.per_op_s
        for r in results
        if r.bench == "decode" and r.impl == impl and r.unit == "step"
    }
    if len(rows) < 2:
        return None
    lo, hi = min(rows), max(rows)
    ratios = [(b / hi) / (a / lo) for a, b in zip(rows[lo], rows[hi], strict=False) if a > 0]
    if not ratios:
        return None
    return statistics.median(ratios), min(ratios), max(ratios)


def _footer(results: list[Result]) -> list[str]:
    lines: list[str] = []
    for impl in sorted({r.impl for r in results if r.bench == "decode"}):
        growth = decode_growth(results, impl)
        if growth is not None:
            sizes = sorted({int(r.params["running"]) for r in results if r.bench == "decode"})
            med, low, high = growth
            lines.append(
                f"decode growth ({impl}), per request-step, running={sizes[-1]:,} / "
                f"running={sizes[0]:,}: {med:.2f} (rounds {low:.2f}-{high:.2f})"
            )
    for mode in ("seqs", "pool"):
        rows = [r for r in results if r.bench == "waiting" and r.params.get("mode") == mode]
        if rows:
            f = flatness(rows)
            verdict = "ok" if f <= WAITING_FLAT else "MISS"
            lines.append(
                f"waiting (blocked by {mode}): max/min over queue lengths = {f:.2f} "
                f"(target <= {WAITING_FLAT}) {verdict}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument(
        "--peer-infinilm", metavar="PATH", help="an InfiniLM checkout (decode fixture)"
    )
    args = parser.parse_args(argv)
    set_clock(args.clock)
    only = selected_fixtures(parser, args, FIXTURES)
    builders: dict[str, Callable[[bool], list[Case]]] = {
        "decode": decode_cases,
        "waiting": waiting_cases,
        "blocked": blocked_cases,
        "burst": burst_cases,
    }
    peers = []
    if args.peer_infinilm is not None:
        from peers import load_peer

        try:
            peers.append(load_peer("infinilm", args.peer_infinilm))
        except (ImportError, OSError) as exc:
            print(f"peer infinilm at {args.peer_infinilm}: cannot load ({exc})")
            return 2
    results: list[Result] = []
    for fixture in FIXTURES:
        if fixture in only:
            cases = builders[fixture](args.quick)
            for peer in peers:
                cases += peer.cases(fixture, args.quick)
            results += run_cases(cases)
    add_ratios(results)
    for r in results:
        if r.case in ADMISSION_US:
            r.note = f"admission {ADMISSION_US[r.case]:.1f} µs/step"
        if r.case in PREFILL_TOKENS:
            r.note = f"{PREFILL_TOKENS[r.case]:,} prompt tokens computed"
    results = [*per_request_rows(results), *results]
    footer = _footer(results)
    print_table("pagedkv.sched benchmarks (time per operation)", results, footer)
    if args.json:
        extra: dict[str, Any] = {"flatness": footer}
        write_json(args.json, results, extra)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
