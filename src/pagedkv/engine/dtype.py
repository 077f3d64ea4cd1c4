"""The compute dtype: ``--dtype auto|float32|bfloat16|float16``, resolved once at load.

``auto`` follows the checkpoint (``config.json``'s ``torch_dtype``, or ``dtype`` in
transformers 5) on CUDA, and picks **float32 on a CPU**, whatever the checkpoint says:

- Upcasting bf16/fp16 weights to fp32 is exact, so the model computes the checkpoint's weights
  with more precise activations, at twice the weight memory.
- Measured on the development machine (AMD EPYC, AVX2, no AVX512-BF16/AMX; 1 thread, a loaded
  2-core VM, so noisy): SmolLM2-135M shapes (30 layers, hidden 576) with random weights decoded
  at batch 1 in 36.7 ms/step in float32 against 202-225 ms/step in bfloat16 (6x slower), and
  at batch 8 in 181-307 ms/step against 5.0-6.0 s/step (over 15x): without bf16 instructions
  torch converts on every matmul. (That was torch's bf16 path, before ``bfloat16`` on a CPU
  became bf16 storage with float32 compute: below.)
- This differs from vLLM on purpose: its CPU backend (``vllm/platforms/cpu.py``, the version
  read) keeps the checkpoint's dtype for ``auto`` and casts float16 to bfloat16 only with an
  FP8 KV cache.

**``bfloat16`` on a CPU is bf16 storage, float32 compute** (issue 15): where the native bf16
kernel builds (``engine/bf16_linear.py``), the linear layers and the vocabulary projection keep
bf16 weights (widened exactly inside the kernel), the KV cache is bf16 (widened on load by the
native decode kernel), and every activation, norm and sum is float32 (``LlamaModel.
compute_dtype``). vLLM's ``--dtype`` names the dtype of "weights and activations"; here, on a
CPU without bf16 arithmetic, only the stored tensors are bf16 and the activations are more
precise than bf16, not less. For a bf16 checkpoint the linears compute the float32 model's
arithmetic on the same weights (only the summation order differs); other checkpoints are
rounded to bf16 once at load. Without a C compiler ``bfloat16`` is torch's bf16 ops, as before
(a warning says so). Quantization with it is refused (``UnsupportedQuantizationError``).
``--matmul-precision medium`` (torch's name for "bf16 inside float32 matmuls") goes one step
further where the CPU has AMX-BF16: the linear layers round their inputs to bf16 and run bf16
arithmetic on AMX tiles (``engine/bf16_dot.py``), as vLLM, transformers and llama.cpp's bf16
paths do; elsewhere it runs as the default ``highest``.

Why ``auto`` still picks float32 on a CPU. Measured on SmolLM2-135M (the Q4_1 GGUF, a quiet
2-core AMD EPYC VM, AVX2; benchmarks/RESULTS.md, "Issue 15: bf16 weights in column tiles"):
since the bf16 weights are kept in column tiles, bfloat16 decodes **2.5x** faster than float32
at batch 1 on one thread (14.8 against 38.0 ms per token in the decode steps) and 3.8x on two
(9.7 against 36.7 ms); on a 2-core Intel Xeon with AVX-512 ("bf16 on AVX-512") 1.9x at one
thread and two, and 2.15x at 16 concurrent requests; quality (the "bf16 weights" section): 128
of 128 greedy tokens equal, mean log-likelihood -2.4e-4 nats from float32. That is a large
gain, but the default's guarantee is exactness (issue 15: "the fp32 path remains
token-identical to transformers"), which bf16 weights and a bf16 KV cache cannot give for a
checkpoint stored in float32 or quantized, and do not give bit for bit even for a bf16 one (the
KV cache rounds). So ``auto`` stays float32 and ``bfloat16`` is one explicit flag away; the
start-up line names the dtype.

An explicit ``float16`` on a CPU is refused (:class:`UnsupportedDtypeError`) unless a probe
finds torch can run the operations the model needs in float16 on this CPU.
"""

from __future__ import annotations

import functools

import torch

from pagedkv.errors import InvalidRequestError

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


class UnsupportedDtypeError(InvalidRequestError):
    """A dtype this device cannot compute in (float16 on a CPU whose torch lacks the kernels)."""


def checkpoint_dtype(torch_dtype: str) -> str:
    """The checkpoint's dtype name, or ``float32`` for anything pagedkv does not compute in."""
    name = torch_dtype.removeprefix("torch.")
    return name if name in DTYPE_CHOICES[1:] else "float32"


def resolve_dtype(requested: str, torch_dtype: str, device: str | torch.device) -> str:
    """The dtype to load and compute in: ``requested`` unless it is ``auto`` (see the module
    docstring). Raises InvalidRequestError for an unknown name, UnsupportedDtypeError for a
    dtype the device cannot run."""
    if requested not in DTYPE_CHOICES:
        raise InvalidRequestError(
            f"unknown dtype {requested!r}; choose one of {', '.join(DTYPE_CHOICES)}"
        )
    on_cpu = torch.device(device).type == "cpu"
    if requested == "auto":
        return "float32" if on_cpu else checkpoint_dtype(torch_dtype)
    if requested == "float16" and on_cpu and not cpu_runs_float16():
        raise UnsupportedDtypeError(
            "dtype float16 cannot run on this CPU (torch has no float16 kernels for the "
            "model's operations here); use --dtype float32 or bfloat16"
        )
    return requested


@functools.cache
def cpu_runs_float16() -> bool:
    """Whether torch runs a matmul, softmax and SDPA in float16 on this CPU (probed once)."""
    try:
        x = torch.ones(2, 4, 8, dtype=torch.float16)
        y = (x @ x.transpose(-1, -2)).softmax(-1)
        z = torch.nn.functional.scaled_dot_product_attention(x[None], x[None], x[None])
        return bool(torch.isfinite(y).all() and torch.isfinite(z).all())
    except RuntimeError:
        return False
