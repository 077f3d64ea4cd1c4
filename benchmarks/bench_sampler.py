"""Benchmark of the batched sampler alone: the cost per token of each request feature.

Run ``python benchmarks/bench_sampler.py`` (about 20 s on 2 cores; ``--quick`` a few seconds).
One operation is one sampled token: a round is one ``sample_batch`` call over 16 sequences
(one row each) of float32 logits over a 49,152-token vocabulary (SmolLM2's size), divided by
16. Each sequence has a 512-token prompt and 64 output tokens. Variants: ``plain``
(temperature 1, top-p 0.95, a seeded generator each); ``logprobs-5`` (plus logprobs with the
top 5); ``penalties`` (presence 0.5, frequency 0.5, repetition 1.1); ``grammar-mask`` (plus a
token bitmask per sequence, as the grammar engine fills it: this times applying it, the
grammar engine's own mask time is ``bench_grammar.py``'s); ``all`` (every one of them).
Ratios are to ``plain`` (above 1: the feature costs that much more per token). One torch
thread; CPU clock (see ``_harness``): the machine is shared.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch

from _harness import (
    Case,
    Result,
    add_ratios,
    base_parser,
    print_table,
    run_cases,
    selected_fixtures,
    set_clock,
    write_json,
)
from pagedkv.engine.batch_sampler import SampleInput, sample_batch
from pagedkv.engine.sampler import SamplingParams, make_generator

VOCAB = 49_152
BATCH = 16
FIXTURES = ("plain", "logprobs-5", "penalties", "grammar-mask", "all")
PENALTIES = {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}


def _inputs(variant: str, seed: int = 0) -> list[SampleInput]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, VOCAB, generator=gen) * 3
    kw: dict[str, object] = {"temperature": 1.0, "top_p": 0.95, "max_tokens": 128}
    if variant in ("logprobs-5", "all"):
        kw["logprobs"] = 5
    if variant in ("penalties", "all"):
        kw.update(PENALTIES)
    params = SamplingParams(**kw)  # type: ignore[arg-type]
    words = (VOCAB + 31) // 32
    out = []
    for i in range(BATCH):
        mask = None
        if variant in ("grammar-mask", "all"):  # about half the vocabulary allowed
            mask = torch.randint(-(2**31), 2**31 - 1, (words,), dtype=torch.int32, generator=gen)
        out.append(
            SampleInput(
                logits[i : i + 1],
                params,
                make_generator(i, torch.device("cpu")),
                [rng.randrange(VOCAB) for _ in range(512)],
                [rng.randrange(VOCAB) for _ in range(64)],
                (),
                mask,
            )
        )
    return out


def cases(quick: bool, only: set[str]) -> list[Case]:
    out = []
    for variant in FIXTURES:
        if variant not in only:
            continue
        inputs = _inputs(variant)
        out.append(
            Case(
                "sampler",
                f"batch={BATCH} vocab={VOCAB}",
                variant,
                "token",
                lambda inputs=inputs: sample_batch(inputs),  # type: ignore[misc]
                ops=BATCH,
                rounds=10 if quick else 40,
                warmup=3,
                interleave="sampler",
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(__doc__.splitlines()[0])
    args = parser.parse_args(argv)
    set_clock(args.clock)
    only = selected_fixtures(parser, args, FIXTURES)
    torch.set_num_threads(1)  # as `pagedkv serve --threads 1`; idle spinning threads blur CPU time
    results: list[Result] = run_cases(cases(args.quick, only))
    add_ratios(results, baseline="plain")
    print_table("batched sampler, time per sampled token", results, ["ratio = variant / plain"])
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
