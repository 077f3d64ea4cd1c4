"""A roofline step-cost model from a model's shape and a device, and KV pool sizing.

One step runs every scheduled token through the layers once. Each part costs the larger of its
compute time and its memory time (the roofline), with efficiency factors for what kernels reach
in practice::

    linear    = max(2 * P * tokens + 2 * V * H * logit_rows     weights: every token, every layer
                    / (F * compute_eff),                         LM head: sampled rows only
                    weight bytes / (B * memory_eff))             weights read once per step
    attention = max(4 * L * heads * head_dim * pairs / (F * compute_eff),
                    context tokens * KV bytes per token / (B * memory_eff))
    comm      = 2 * L * (link_latency + 2 (T - 1) / T * tokens * H * bytes / link_bw)   (T > 1)
    step      = linear + attention + comm + per_step_overhead + per_seq_overhead * seqs

``pairs`` is the number of (query, key) positions attention computes: a chunk of ``n`` tokens
after ``s`` cached ones makes ``n*s + n(n+1)/2`` (causal), so prefill is quadratic in context;
``context tokens`` is the KV each scheduled request reads (``s + n``). With tensor parallelism
``T`` every GPU does 1/T of the FLOPs and bytes (KV heads fewer than T are replicated), and two
all-reduces per layer (ring: each GPU sends ``2 (T - 1) / T`` of the activations) cost link time.

Default efficiencies: 60% of peak FLOP/s on large GEMMs and flash attention (typical measured
MFU of bf16 prefill on H100/A100), 80% of peak memory bandwidth (what a weight-streaming
decode GEMV reaches), 1 ms of per-step overhead (scheduling, input preparation, sampling) and
10 µs per sequence, 10 µs per all-reduce. With them Llama-3-8B bf16 on one H100 prefills at
~24 µs per token and decodes one sequence in ~7 ms per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedkv.errors import InvalidRequestError
from pagedkv.sim.hardware import DeviceSpec, GiB, ModelSpec


@dataclass(frozen=True, slots=True)
class RooflineCost:
    """Step times from ``model`` on ``tensor_parallel_size`` x ``device`` (module docstring)."""

    model: ModelSpec
    device: DeviceSpec
    tensor_parallel_size: int = 1
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    per_step_overhead_s: float = 1e-3
    per_seq_overhead_s: float = 10e-6
    link_latency_s: float = 10e-6

    def __post_init__(self) -> None:
        t = self.tensor_parallel_size
        if t <= 0:
            raise InvalidRequestError(f"tensor_parallel_size must be positive, got {t}")
        if self.model.num_heads % t:
            raise InvalidRequestError(
                f"tensor_parallel_size={t} does not divide {self.model.name}'s "
                f"{self.model.num_heads} attention heads"
            )
        for f in ("compute_efficiency", "memory_efficiency"):
            v = getattr(self, f)
            if not 0.0 < v <= 1.0:
                raise InvalidRequestError(f"{f} must be in (0, 1], got {v}")
        for f in ("per_step_overhead_s", "per_seq_overhead_s", "link_latency_s"):
            v = getattr(self, f)
            if not (math.isfinite(v) and v >= 0.0):
                raise InvalidRequestError(f"{f} must be a finite number >= 0, got {v}")

    @property
    def kv_bytes_per_token_per_gpu(self) -> int:
        """One token's K and V on one GPU (KV heads split over the GPUs, replicated if fewer)."""
        m = self.model
        heads = math.ceil(m.num_kv_heads / self.tensor_parallel_size)
        return 2 * m.num_layers * heads * m.head_dim * m.dtype_bytes

    def step_time(
        self,
        num_prefill_tokens: int,
        num_decode_seqs: int,
        num_context_tokens: int = 0,
        num_attention_pairs: int = 0,
        num_logit_rows: int | None = None,
    ) -> float:
        """Seconds for one step with these totals (an empty step costs nothing).

        ``num_attention_pairs`` defaults to the decodes' context (each decode token attends to
        its request's whole context); ``num_logit_rows`` to the decodes (one sample each).
        """
        tokens = num_prefill_tokens + num_decode_seqs
        if tokens == 0:
            return 0.0
        m, d, t = self.model, self.device, self.tensor_parallel_size
        flops = d.peak_flops * self.compute_efficiency * t
        bandwidth = d.memory_bytes_per_s * self.memory_efficiency
        rows = num_decode_seqs if num_logit_rows is None else num_logit_rows
        lm_head = m.vocab_size * m.hidden_size
        linear_flops = 2 * m.num_linear_params * tokens + 2 * lm_head * rows
        weight_read = (m.num_linear_params + lm_head) * m.dtype_bytes / t
        linear = max(linear_flops / flops, weight_read / bandwidth)
        pairs = num_attention_pairs if num_attention_pairs else num_context_tokens
        attn_flops = 4 * m.num_layers * m.num_heads * m.head_dim * pairs
        kv_read = num_context_tokens * self.kv_bytes_per_token_per_gpu
        attention = max(attn_flops / flops, kv_read / bandwidth)
        comm = 0.0
        if t > 1:
            payload = tokens * m.hidden_size * m.dtype_bytes * 2 * (t - 1) / t
            comm = 2 * m.num_layers * (self.link_latency_s + payload / d.link_bytes_per_s)
        seqs = num_decode_seqs + (1 if num_prefill_tokens else 0)
        return linear + attention + comm + self.per_step_overhead_s + self.per_seq_overhead_s * seqs


@dataclass(frozen=True, slots=True)
class PoolSizing:
    """How a pool size was derived (per GPU): what the device holds and where it goes."""

    num_blocks: int  # physical blocks, the null block included
    device_bytes: int
    usable_bytes: int  # device_bytes * gpu_memory_utilization
    weight_bytes: int
    activation_bytes: int
    runtime_bytes: int
    kv_bytes: int  # usable - weights - activations - runtime
    block_bytes: int


def size_pool(
    cost: RooflineCost,
    *,
    block_size: int,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 128,
    runtime_bytes: int = 1 * GiB,
) -> PoolSizing:
    """KV blocks as engines size them: device memory x utilization - weights - activations.

    Activations are one layer's peak for a full step budget (hidden states, q/k/v, the gated
    MLP's two intermediate tensors) plus fp32 logits for every sequence; ``runtime_bytes``
    stands for the CUDA context, library workspaces and graphs. Raises InvalidRequestError
    when nothing is left for the KV cache.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise InvalidRequestError(
            f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
        )
    m, t = cost.model, cost.tensor_parallel_size
    device = cost.device.memory_bytes
    usable = int(device * gpu_memory_utilization)
    weights = math.ceil(m.weight_bytes / t)
    per_token = (4 * m.hidden_size + 3 * m.intermediate_size) * m.dtype_bytes // t
    activations = max_num_batched_tokens * per_token + max_num_seqs * m.vocab_size * 4
    kv = usable - weights - activations - runtime_bytes
    block_bytes = block_size * cost.kv_bytes_per_token_per_gpu
    num_blocks = kv // block_bytes if kv > 0 else 0
    if num_blocks < 2:
        raise InvalidRequestError(
            f"{m.name} on {t} x {cost.device.name}: {usable / GiB:.1f} GiB usable per GPU "
            f"({gpu_memory_utilization:.0%} of {device / GiB:.0f} GiB) less {weights / GiB:.1f} "
            f"GiB of weights, {activations / GiB:.2f} GiB of activations and "
            f"{runtime_bytes / GiB:.1f} GiB of runtime leaves no room for the KV cache"
        )
    return PoolSizing(
        num_blocks, device, usable, weights, activations, runtime_bytes, kv, block_bytes
    )


@dataclass(frozen=True, slots=True)
class MemoryPool:
    """A pool sized from device memory: the model and device it was sized for (``roofline``)
    and the share of memory given to the engine. Variants that change the device, the tensor
    parallelism, the block size or the step budget size their pool again from it."""

    roofline: RooflineCost
    gpu_memory_utilization: float = 0.9

    def num_blocks(self, block_size: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        return size_pool(
            self.roofline,
            block_size=block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
        ).num_blocks
