"""``pagedkv profile --model DIR``: measure this engine's steps and write a profile CSV that
``pagedkv simulate --profile`` fits (pagedkv.sim.profile)."""

from __future__ import annotations

import argparse
import sys

import torch

from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.profiler import StepRow, profile_engine
from pagedkv.errors import InvalidRequestError, PagedKVError
from pagedkv.sim.profile import COLUMNS, fit_profile, write_profile


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise InvalidRequestError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise InvalidRequestError(f"expected positive integers, got {text!r}")
    return values


def _measure(a: argparse.Namespace) -> list[StepRow]:
    engine = LLMEngine.from_model_dir(
        a.model, EngineConfig(device=a.device, enable_prefix_caching=False)
    )
    try:
        return profile_engine(
            engine,
            prompt_lens=_ints(a.prompt_lens),
            batch_sizes=_ints(a.batch_sizes),
            max_tokens=a.max_tokens,
            clock=a.clock,
            repeats=a.repeats,
        )
    finally:
        engine.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pagedkv profile", description=__doc__)
    p.add_argument("--model", required=True, metavar="DIR", help="a model folder")
    p.add_argument("--out", default="profile.csv", help="where to write the CSV")
    p.add_argument("--prompt-lens", default="16,128,512", help="prompt lengths of the grid")
    p.add_argument("--batch-sizes", default="1,4,16", help="batch sizes of the grid")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens each request generates")
    p.add_argument(
        "--repeats", type=int, default=1, help="run the grid this many times; keep medians"
    )
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's; 1 with --clock cpu, whose CPU time "
        "would count the spinning of idle intra-op threads)",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time steps by the wall clock, or by process CPU time (for a shared machine)",
    )
    a = p.parse_args(argv)
    threads = 1 if a.threads is None and a.clock == "cpu" else a.threads
    before = torch.get_num_threads()
    try:
        if threads is not None:
            if threads <= 0:
                raise InvalidRequestError(f"--threads must be positive, got {threads}")
            torch.set_num_threads(threads)
        rows = _measure(a)
        write_profile(rows, a.out)
        fit = fit_profile(rows)
    except (PagedKVError, OSError) as exc:
        print(f"pagedkv profile: error: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(before)  # the process's setting again (main may run in-process)
    c = fit.cost
    print(
        f"wrote {len(rows)} steps ({', '.join(COLUMNS)}) to {a.out}; fit: "
        f"{c.per_step_s * 1e3:.3f} ms/step + {c.per_prefill_token_s * 1e6:.2f} µs/prefill token"
        f" + {c.per_decode_seq_s * 1e6:.2f} µs/decode + {c.per_context_token_s * 1e9:.2f} "
        f"ns/context token + {c.per_attention_pair_s * 1e9:.3f} ns/attention pair + "
        f"{c.per_logit_row_s * 1e6:.2f} µs/logit row (R^2 {fit.r2:.3f})"
    )
    return 0
