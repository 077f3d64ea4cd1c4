"""Model shapes and device specs: what a roofline cost model and pool sizing are built from.

A :class:`ModelSpec` comes from a preset name (:data:`MODEL_PRESETS`) or a Hugging Face
``config.json`` (dense decoder-only transformers with a gated MLP: Llama, Mistral, Qwen2,
SmolLM; a mixture-of-experts config is refused, not approximated). A :class:`DeviceSpec` comes
from :data:`DEVICE_PRESETS`; every number there is the vendor's datasheet figure, dense (the
datasheets print sparse tensor FLOP/s first; dense is half), with its source beside it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedkv.errors import InvalidRequestError

_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4}
GiB = 2**30


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a dense decoder-only transformer (gated MLP: gate, up and down projections).

    Invariants: every count > 0; ``num_heads % num_kv_heads == 0`` (grouped-query attention).
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for f in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
            "vocab_size",
            "dtype_bytes",
        ):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise InvalidRequestError(
                    f"model {self.name!r}: {f} must be a positive int, got {v!r}"
                )
        if self.num_heads % self.num_kv_heads:
            raise InvalidRequestError(
                f"model {self.name!r}: num_heads={self.num_heads} is not a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )

    @property
    def num_layer_params(self) -> int:
        """Weights of one layer's linear maps: q, k, v, o and the gated MLP (norms left out)."""
        h, d = self.hidden_size, self.head_dim
        attn = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        return attn + 3 * h * self.intermediate_size

    @property
    def num_linear_params(self) -> int:
        """Weights every token passes through: all layers (the LM head apart)."""
        return self.num_layers * self.num_layer_params

    @property
    def num_params(self) -> int:
        """All weights: the layers, the embedding, and the LM head unless it is tied."""
        emb = self.vocab_size * self.hidden_size
        return self.num_linear_params + emb * (1 if self.tie_word_embeddings else 2)

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One accelerator: dense bf16/fp16 tensor FLOP/s, memory bandwidth and size, and the
    per-direction bandwidth of the link tensor-parallel all-reduces use."""

    name: str
    peak_flops: float
    memory_bytes_per_s: float
    memory_bytes: int
    link_bytes_per_s: float
    source: str = ""

    def __post_init__(self) -> None:
        for f in ("peak_flops", "memory_bytes_per_s", "memory_bytes", "link_bytes_per_s"):
            v = getattr(self, f)
            if not (math.isfinite(v) and v > 0):
                raise InvalidRequestError(f"device {self.name!r}: {f} must be > 0, got {v!r}")


# Model shapes as their config.json files on the Hugging Face hub give them.
MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256),
        ModelSpec("llama-3-70b", 80, 8192, 64, 8, 128, 28672, 128256),
        ModelSpec("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000),
        ModelSpec("mistral-7b", 32, 4096, 32, 8, 128, 14336, 32000),  # v0.1
        ModelSpec("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064),
        ModelSpec("qwen2.5-0.5b", 24, 896, 14, 2, 64, 4864, 151936, tie_word_embeddings=True),
        ModelSpec("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tie_word_embeddings=True),
    )
}

_T = 1e12
_GBs = 1e9
# Dense tensor FLOP/s (bf16, fp32 accumulate), memory bandwidth, memory size (nominal: the driver
# reports ~1% less), link bandwidth per direction (NVLink totals are bidirectional: halved).
DEVICE_PRESETS: dict[str, DeviceSpec] = {
    d.name: d
    for d in (
        DeviceSpec(
            "H100",
            989.5 * _T,
            3350 * _GBs,
            80 * GiB,
            450 * _GBs,
            "NVIDIA H100 Tensor Core GPU datasheet, SXM5: BF16 1,979 TFLOPS with sparsity, "
            "80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s",
        ),
        DeviceSpec(
            "H100-PCIE",
            756.5 * _T,
            2000 * _GBs,
            80 * GiB,
            300 * _GBs,
            "NVIDIA H100 datasheet, PCIe: BF16 1,513 TFLOPS with sparsity, 80 GB HBM2e at "
            "2 TB/s, NVLink bridge 600 GB/s",
        ),
        DeviceSpec(
            "H200",
            989.5 * _T,
            4800 * _GBs,
            141 * GiB,
            450 * _GBs,
            "NVIDIA H200 Tensor Core GPU datasheet, SXM: BF16 1,979 TFLOPS with sparsity, "
            "141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s",
        ),
        DeviceSpec(
            "A100-40",
            312 * _T,
            1555 * _GBs,
            40 * GiB,
            300 * _GBs,
            "NVIDIA A100 Tensor Core GPU datasheet, SXM 40GB: BF16 312 TFLOPS dense, HBM2 at "
            "1,555 GB/s, NVLink 600 GB/s",
        ),
        DeviceSpec(
            "A100-80",
            312 * _T,
            2039 * _GBs,
            80 * GiB,
            300 * _GBs,
            "NVIDIA A100 Tensor Core GPU datasheet, SXM 80GB: BF16 312 TFLOPS dense, HBM2e at "
            "2,039 GB/s, NVLink 600 GB/s",
        ),
        DeviceSpec(
            "L4",
            121 * _T,
            300 * _GBs,
            24 * GiB,
            32 * _GBs,
            "NVIDIA L4 Tensor Core GPU datasheet: BF16 242 TFLOPS with sparsity, 24 GB GDDR6 "
            "at 300 GB/s, PCIe Gen4 x16 64 GB/s",
        ),
        DeviceSpec(
            "L40S",
            362.05 * _T,
            864 * _GBs,
            48 * GiB,
            32 * _GBs,
            "NVIDIA L40S datasheet: BF16 362.05 TFLOPS dense (733 with sparsity), 48 GB GDDR6 "
            "at 864 GB/s, PCIe Gen4 x16 64 GB/s",
        ),
        DeviceSpec(
            "RTX4090",
            165.2 * _T,
            1008 * _GBs,
            24 * GiB,
            32 * _GBs,
            "NVIDIA Ada Lovelace GPU architecture whitepaper, RTX 4090: peak BF16 tensor "
            "165.2 TFLOPS with FP32 accumulate, 24 GB GDDR6X at 1,008 GB/s, PCIe Gen4 x16",
        ),
        DeviceSpec(
            "MI300X",
            1307.4 * _T,
            5300 * _GBs,
            192 * GiB,
            448 * _GBs,
            "AMD Instinct MI300X datasheet: peak BF16 1,307.4 TFLOPS dense, 192 GB HBM3 at "
            "5.3 TB/s, Infinity Fabric 896 GB/s aggregate",
        ),
    )
}


def device_spec(name: str) -> DeviceSpec:
    """A preset device by name (case-insensitive)."""
    for key, spec in DEVICE_PRESETS.items():
        if key.lower() == name.strip().lower():
            return spec
    raise InvalidRequestError(f"unknown device {name!r}; known: {', '.join(DEVICE_PRESETS)}")


def _field(cfg: dict[str, Any], where: str, *names: str, default: int | None = None) -> int:
    for n in names:
        if n in cfg and cfg[n] is not None:
            v = cfg[n]
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidRequestError(f"{where}: {n} must be an integer, got {v!r}")
            return v
    if default is None:
        raise InvalidRequestError(f"{where}: missing {' or '.join(names)}")
    return default


def model_spec_from_config(cfg: dict[str, Any], name: str) -> ModelSpec:
    """A ModelSpec from a decoded Hugging Face ``config.json`` (``text_config`` if nested)."""
    if isinstance(cfg.get("text_config"), dict):
        cfg = cfg["text_config"]
    moe = [k for k in ("num_local_experts", "num_experts", "n_routed_experts") if cfg.get(k)]
    if moe:
        raise InvalidRequestError(
            f"{name}: a mixture-of-experts model ({moe[0]}={cfg[moe[0]]}) is not modelled"
        )
    hidden = _field(cfg, name, "hidden_size", "n_embd")
    heads = _field(cfg, name, "num_attention_heads", "n_head")
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")
    if dtype not in _DTYPE_BYTES:
        raise InvalidRequestError(f"{name}: unsupported dtype {dtype!r}")
    return ModelSpec(
        name=name,
        num_layers=_field(cfg, name, "num_hidden_layers", "n_layer"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=_field(cfg, name, "num_key_value_heads", default=heads),
        head_dim=_field(cfg, name, "head_dim", default=hidden // heads),
        intermediate_size=_field(cfg, name, "intermediate_size"),
        vocab_size=_field(cfg, name, "vocab_size"),
        dtype_bytes=_DTYPE_BYTES[dtype],
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


def model_spec(name_or_path: str) -> ModelSpec:
    """A preset (case-insensitive) or a ``config.json`` file, or a folder holding one."""
    key = name_or_path.strip().lower()
    if key in MODEL_PRESETS:
        return MODEL_PRESETS[key]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise InvalidRequestError(
            f"--model-config {name_or_path!r} is neither a preset ({', '.join(MODEL_PRESETS)}) "
            "nor a config.json file"
        )
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InvalidRequestError(f"cannot read model config {path}: {exc}") from None
    if not isinstance(cfg, dict):
        raise InvalidRequestError(f"{path}: expected a JSON object")
    return model_spec_from_config(cfg, path.parent.name or path.name)
