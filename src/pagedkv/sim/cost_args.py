"""The step-cost and pool-size options of ``pagedkv simulate`` (and ``pagedkv plan``).

Three sources of step costs, one at a time:

* the constant model (:class:`~pagedkv.sim.cost_model.CostModel`, the default, kept for old
  reports to stay comparable) with ``--per-step-ms`` and its three siblings;
* the roofline of ``--model-config`` on ``--device`` x ``--tensor-parallel-size``;
* ``--profile FILE.csv``, measured steps fitted by least squares.

The pool is ``--num-blocks`` when given; otherwise, with ``--model-config``, sized as engines
size it (device memory x ``--gpu-memory-utilization`` - weights - activations); otherwise the
old default of 4,096 blocks. An option that the chosen source would ignore is refused.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pagedkv.errors import InvalidRequestError
from pagedkv.sim.cost_model import CostModel, StepCost
from pagedkv.sim.hardware import DEVICE_PRESETS, MODEL_PRESETS, GiB, device_spec, model_spec
from pagedkv.sim.profile import load_profile
from pagedkv.sim.roofline import MemoryPool, RooflineCost, size_pool

DEFAULT_NUM_BLOCKS = 4096
_CONSTANT = {  # flag -> (CostModel field, unit to seconds)
    "per_step_ms": ("per_step_s", 1e-3),
    "per_prefill_token_us": ("per_prefill_token_s", 1e-6),
    "per_decode_seq_us": ("per_decode_seq_s", 1e-6),
    "per_context_token_ns": ("per_context_token_s", 1e-9),
}


@dataclass(frozen=True, slots=True)
class CostChoice:
    """The resolved step cost, the pool size in blocks and a line saying where both came from."""

    cost: StepCost
    num_blocks: int
    note: str
    memory_pool: MemoryPool | None = None  # when num_blocks was sized from device memory


def add_cost_arguments(p: argparse.ArgumentParser) -> None:
    d = CostModel()
    m = p.add_argument_group(
        "step cost model (default: constants for a 7-8B model on one H100-class GPU, "
        "pagedkv.sim.cost_model; or a roofline from --model-config, or --profile)"
    )
    m.add_argument(
        "--model-config",
        metavar="FILE|NAME",
        help=f"a config.json (or its folder) or a preset: {', '.join(MODEL_PRESETS)}",
    )
    m.add_argument(
        "--device",
        help=f"with --model-config (default H100): {', '.join(DEVICE_PRESETS)}",
    )
    m.add_argument(
        "--tensor-parallel-size", type=int, help="GPUs per replica, with --model-config (1)"
    )
    m.add_argument(
        "--gpu-memory-utilization",
        type=float,
        help="share of device memory for weights, activations and KV, with --model-config (0.9)",
    )
    m.add_argument("--profile", metavar="FILE.csv", help="measured step times to fit and use")
    for flag, (field, unit) in _CONSTANT.items():
        default = getattr(d, field) / unit
        m.add_argument(
            "--" + flag.replace("_", "-"),
            type=float,
            help=f"constant model: {field.removeprefix('per_').removesuffix('_s')} cost "
            f"(default {default:g})",
        )


def _constant(a: argparse.Namespace) -> CostModel:
    given = {f: getattr(a, k) * u for k, (f, u) in _CONSTANT.items() if getattr(a, k) is not None}
    return CostModel(**given)


def resolve_cost(
    a: argparse.Namespace, *, block_size: int, max_num_batched_tokens: int, max_num_seqs: int
) -> CostChoice:
    """The cost model and pool the options ask for; a conflicting option is refused."""
    constant_flags = [k for k in _CONSTANT if getattr(a, k) is not None]
    roofline_flags = [
        k
        for k in ("device", "tensor_parallel_size", "gpu_memory_utilization")
        if getattr(a, k) is not None
    ]
    if constant_flags and (a.model_config or a.profile):
        raise InvalidRequestError(
            f"--{constant_flags[0].replace('_', '-')} sets the constant cost model; it cannot "
            "be combined with --model-config or --profile"
        )
    if roofline_flags and not a.model_config:
        raise InvalidRequestError(
            f"--{roofline_flags[0].replace('_', '-')} needs --model-config (the model it runs)"
        )
    roofline = None
    if a.model_config:
        roofline = RooflineCost(
            model_spec(a.model_config),
            device_spec(a.device or "H100"),
            tensor_parallel_size=a.tensor_parallel_size or 1,
        )
    cost: StepCost
    if a.profile:
        fit = load_profile(a.profile)
        cost = fit.cost
        note = f"step costs fitted to {fit.num_rows} measured steps (R^2 {fit.r2:.4f})"
    elif roofline is not None:
        cost = roofline
        note = (
            f"roofline step costs: {roofline.model.name} on {roofline.tensor_parallel_size} x "
            f"{roofline.device.name}"
        )
    else:
        cost = _constant(a)
        note = "constant step costs (pagedkv.sim.cost_model)"
    if a.num_blocks is not None:
        return CostChoice(cost, a.num_blocks, note + f"; pool {a.num_blocks:,} blocks (given)")
    if roofline is None:
        return CostChoice(cost, DEFAULT_NUM_BLOCKS, note)
    util = 0.9 if a.gpu_memory_utilization is None else a.gpu_memory_utilization
    sizing = size_pool(
        roofline,
        block_size=block_size,
        gpu_memory_utilization=util,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
    )
    note += (
        f"; pool {sizing.num_blocks:,} blocks = {sizing.kv_bytes / GiB:.1f} GiB of KV per GPU "
        f"({util:.0%} of {sizing.device_bytes / GiB:.0f} GiB less {sizing.weight_bytes / GiB:.1f} "
        f"GiB weights, {sizing.activation_bytes / GiB:.2f} GiB activations, "
        f"{sizing.runtime_bytes / GiB:.1f} GiB runtime)"
    )
    return CostChoice(cost, sizing.num_blocks, note, MemoryPool(roofline, util))
