"""Load a Llama-family model straight from one GGUF file (llama.cpp's checkpoint format).

The file is read with ``gguf.GGUFReader`` (a memory map: nothing is read twice). Its metadata
becomes a :class:`ModelConfig` (``gguf_config``), each tensor is dequantized to float32 with
``gguf_quants`` and cast to the compute dtype, renamed to the Hugging Face names the engine's
model expects, and llama.cpp's Q/K row permutation is undone for llama/mistral. The tokenizer is
rebuilt from the metadata (``gguf_tokenizer``). The checkpoint's identity for cache namespaces is
a hash of the file's bytes (``gguf_fingerprint``), never its path.

Every failure (not a GGUF file, an unsupported architecture, tensor type or tensor) raises
:class:`ModelLoadError` naming it.

``quantization="gguf"`` (``--quantization gguf``, vLLM's name for GGUF weights) keeps the linear
layers whose tensors are Q8_0, Q4_0 or Q4_1 as the file's blocks (``gguf_qlinear``), and the
vocabulary projection too when its tensor (``output.weight``, or ``token_embd.weight`` when
tied) is one of those; the embedding lookup, the norms, and every tensor of another type stay
float32. A fused group (q/k/v, gate/up) is kept only when all its tensors share one kept type.
The default (None) stays float32 dequantized at load, exactly as before. The loader leaves
that step in the model's ``deferred_quantization``, so ``LlamaModel.quantize("gguf")`` applies
it (the engine calls it when its config asks, with nothing GGUF-specific of its own); until then
the function holds the reader's memory map (file-backed pages, evictable).
"""

from __future__ import annotations

import logging
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import xxhash

from pagedkv.engine.gguf_config import PERMUTED_QK_ARCHS, gguf_model_config
from pagedkv.engine.gguf_qlinear import KEPT_TYPES, GGUFProjection, concat_rows, from_gguf_bytes
from pagedkv.engine.gguf_quants import SUPPORTED_TYPES, dequantize
from pagedkv.engine.gguf_tokenizer import gguf_tokenizer
from pagedkv.engine.kv_cache import parse_dtype
from pagedkv.engine.model_config import ModelConfig
from pagedkv.engine.models.llama import LlamaModel
from pagedkv.engine.qlinear import UnsupportedQuantizationError
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import ModelLoadError

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HASH_CHUNK_BYTES = 64 << 20


def is_gguf_file(path: str | Path) -> bool:
    """True when ``path`` is a file that starts with the GGUF magic."""
    p = Path(path)
    if not p.is_file():
        return False
    try:
        with p.open("rb") as fh:
            return fh.read(4) == GGUF_MAGIC
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class GGUFFile:
    """An opened GGUF file: its reader (a memory map) and its metadata as plain values."""

    path: Path
    reader: Any  # gguf.GGUFReader (the gguf package ships no type information)
    metadata: dict[str, Any]

    @classmethod
    def open(cls, path: str | Path) -> GGUFFile:
        p = Path(path)
        if not is_gguf_file(p):
            raise ModelLoadError(f"{p} is not a GGUF file (missing, or no GGUF magic)")
        try:
            from gguf import GGUFReader
        except ImportError as exc:
            raise ModelLoadError(
                "reading GGUF files needs the gguf package: pip install 'gguf>=0.10'"
            ) from exc
        size = p.stat().st_size
        try:
            reader = GGUFReader(str(p))
            meta = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
        except (ValueError, OSError, KeyError, IndexError) as exc:
            raise ModelLoadError(
                f"cannot read GGUF file {p} ({size} bytes; truncated or corrupt?): {exc}"
            ) from exc
        return cls(p, reader, meta)

    def tensor_names(self) -> set[str]:
        return {str(t.name) for t in self.reader.tensors}


def gguf_fingerprint(gguf_file: GGUFFile) -> str:
    """The checkpoint's identity: ``gguf-<xxh3-128 of every byte of the file>``.

    A content hash, so a file replaced by other weights under the same path gets another
    namespace (and its KV is never served the old weights' blocks), and a copy elsewhere keeps
    it. Costs one pass over the file (~0.3 s for SmolLM2's 98 MB, dominated by the page cache).
    """
    data = gguf_file.reader.data
    h = xxhash.xxh3_128()
    for start in range(0, len(data), _HASH_CHUNK_BYTES):
        h.update(memoryview(data[start : start + _HASH_CHUNK_BYTES]))
    return f"gguf-{h.hexdigest()}"


def hf_tensor_name(gguf_name: str) -> str:
    """The Hugging Face name of a GGUF tensor; ModelLoadError for a tensor the model lacks."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no place in the engine's model")
    return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's converter permutation of Q/K rows (weight ``[out, in]`` or bias
    ``[out]``). The converter interleaves each head's two rotary halves: per head, rows
    ``[h0 .. h(d/2-1) | h(d/2) .. h(d-1)]`` become ``[h0, h(d/2), h1, h(d/2+1), ...]``; this
    is its inverse."""
    rows = weight.shape[0]
    rest = weight.shape[1:]
    head_dim = rows // num_heads
    w = weight.reshape(num_heads, head_dim // 2, 2, *rest)
    return w.transpose(1, 2).reshape(rows, *rest)


def load_gguf_model(
    path: str | Path | GGUFFile,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    progress: bool | None = None,
    quantization: str | None = None,
) -> LlamaModel:
    """Build a :class:`LlamaModel` from a GGUF file, weights dequantized to ``dtype`` (default
    float32, the precision of dequantized values). ``progress`` (default: stderr is a terminal)
    shows a bar on stderr. ``quantization`` applies ``LlamaModel.quantize`` to the result;
    ``"gguf"`` (left in ``deferred_quantization`` for a later ``quantize("gguf")`` too, as the
    engine calls it) keeps the file's quantized linears (module docstring)."""
    gf = path if isinstance(path, GGUFFile) else GGUFFile.open(path)
    tensors = {str(t.name): t for t in gf.reader.tensors}
    rope_freqs = None
    if "rope_freqs.weight" in tensors:
        rope_freqs = torch.from_numpy(_dequantize(tensors.pop("rope_freqs.weight")).copy())
    embd = tensors.get("token_embd.weight")
    rows = None if embd is None else int(embd.shape[-1])  # GGUF dims: [hidden, vocab]
    config = gguf_model_config(gf.metadata, set(tensors), rope_freqs, rows)
    target = parse_dtype("float32" if dtype in (None, "auto") else dtype)
    # refuse unknown tensors and types before dequantizing anything
    names = {name: hf_tensor_name(name) for name in tensors}
    bad = sorted(
        f"{t.tensor_type.name} ({n})"
        for n, t in tensors.items()
        if t.tensor_type.name not in SUPPORTED_TYPES
    )
    if bad:
        raise ModelLoadError(
            f"unsupported GGUF tensor types: {', '.join(bad[:4])}; "
            f"supported: {', '.join(SUPPORTED_TYPES)}"
        )
    weights: dict[str, torch.Tensor] = {}
    show = sys.stderr.isatty() if progress is None else progress
    with _progress_bar(show, len(tensors), gf.path.name) as advance:
        for name, info in tensors.items():
            weights[names[name]] = _to_torch(info, config, target, device)
            advance()
    logger.info("loaded %d tensors from %s (%s, %s)", len(weights), gf.path, target, device)
    model = LlamaModel(config, weights, device)
    model.deferred_quantization["gguf"] = partial(_keep_quantized, tensors=tensors, path=gf.path)
    if quantization is not None:
        model.quantize(quantization)
    return model


def _keep_quantized(
    model: LlamaModel, *, tensors: dict[str, Any], path: Path, activations: str = "float32"
) -> None:
    """Install :class:`GGUFProjection` s for the kept tensors (module docstring), computing
    with ``activations`` (``"int8"``: :mod:`pagedkv.engine.gguf_q8act`, set by
    ``gguf_q8act.set_gguf_activations``). Raises UnsupportedQuantizationError when no linear
    layer's tensor has a kept type."""
    config = model.config
    kept: dict[str, GGUFProjection] = {}
    for name, info in tensors.items():
        type_name = str(info.tensor_type.name)
        if type_name not in KEPT_TYPES or not name.endswith(".weight") or len(info.shape) != 2:
            continue
        in_dim, out_dim = (int(d) for d in info.shape.tolist())  # GGUF dims: fastest first
        proj = from_gguf_bytes(type_name, info.data, out_dim, in_dim)
        if config.model_type in PERMUTED_QK_ARCHS and (".attn_q." in name or ".attn_k." in name):
            heads = config.num_attention_heads if ".attn_q." in name else config.num_key_value_heads
            proj = GGUFProjection(type_name, unpermute_qk(proj.blocks, heads).contiguous(), in_dim)
        kept[hf_tensor_name(name).removesuffix(".weight")] = replace(proj, activations=activations)

    def make(prefixes: list[str]) -> GGUFProjection | None:
        parts = [kept.get(p) for p in prefixes]
        if any(p is None for p in parts) or len({p.type_name for p in parts if p}) != 1:
            return None
        bias = [model.weights.get(f"{p}.bias") for p in prefixes]
        with_bias = [
            p if b is None else replace(p, bias=b.float().contiguous())
            for p, b in zip(parts, bias, strict=True)
            if p is not None
        ]
        return concat_rows(with_bias)

    head_name = "model.embed_tokens" if config.tie_word_embeddings else "lm_head"
    num_linears = len([n for n in kept if n.endswith("_proj")])
    if num_linears == 0:
        types = sorted({str(t.tensor_type.name) for t in tensors.values() if len(t.shape) == 2})
        raise UnsupportedQuantizationError(
            f"--quantization gguf: no linear layer of {path.name} is {'/'.join(KEPT_TYPES)} "
            f"(its 2-D tensor types: {', '.join(types)}); load it without the flag"
        )
    model.replace_linears("gguf", make, kept.get(head_name))
    logger.info(
        "gguf quantization: %d linear tensors kept quantized, vocabulary projection %s",
        num_linears,
        kept[head_name].type_name if head_name in kept else "float32",
    )


def _dequantize(info: Any) -> np.ndarray[Any, np.dtype[np.float32]]:
    """One tensor's values as float32 in numpy's (row-major) shape: GGUF lists dims fastest
    first, so the shape is reversed."""
    type_name = str(info.tensor_type.name)
    shape = tuple(int(d) for d in reversed(info.shape.tolist()))
    try:
        flat = dequantize(info.data, type_name, int(info.n_elements))
    except ModelLoadError as exc:
        raise ModelLoadError(f"tensor {info.name}: {exc}") from None
    return flat.reshape(shape)


def _to_torch(
    info: Any, config: ModelConfig, target: torch.dtype, device: str | torch.device
) -> torch.Tensor:
    tensor = torch.from_numpy(_dequantize(info))
    name = str(info.name)
    if config.model_type in PERMUTED_QK_ARCHS:
        if ".attn_q." in name:
            tensor = unpermute_qk(tensor, config.num_attention_heads)
        elif ".attn_k." in name:
            tensor = unpermute_qk(tensor, config.num_key_value_heads)
    # dequantize() returned fresh memory: the result is never a view of the memory map
    return tensor.to(device=device, dtype=target).contiguous()


@contextmanager
def _progress_bar(show: bool, total: int, label: str) -> Iterator[Any]:
    if not show:
        yield lambda: None
        return
    from rich.console import Console
    from rich.progress import Progress

    with Progress(console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(f"loading {label}", total=total)
        yield lambda: bar.advance(task)


@dataclass(frozen=True, slots=True)
class GGUFCheckpoint:
    """Everything the engine takes from one GGUF file."""

    model: LlamaModel
    tokenizer: Tokenizer | None
    fingerprint: str  # the cache namespace / hash root: see gguf_fingerprint


def load_gguf_checkpoint(
    path: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> GGUFCheckpoint:
    """Open ``path`` once and build the model, its tokenizer and its fingerprint."""
    gf = GGUFFile.open(path)
    tokenizer = gguf_tokenizer(gf.metadata)  # first: a bad vocabulary fails before the weights
    model = load_gguf_model(gf, dtype=dtype, device=device)
    return GGUFCheckpoint(model, tokenizer, gguf_fingerprint(gf))
