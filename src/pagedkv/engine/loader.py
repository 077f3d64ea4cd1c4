"""Load a Llama-family model from a local Hugging Face folder.

Reads ``config.json`` and ``*.safetensors`` (one file, or shards listed by
``model.safetensors.index.json``), converts tensors to the requested dtype and places them on the
device. Missing files, unknown architectures and missing tensors raise ModelLoadError with the path
and the names involved.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pagedkv.engine.kv_cache import parse_dtype
from pagedkv.engine.model_config import ModelConfig
from pagedkv.engine.models.llama import LlamaModel
from pagedkv.errors import ModelLoadError

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a folder: the index's shards when an index exists, else every
    ``*.safetensors`` file."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read the shard index {index}: {exc}") from exc
        names = sorted(set(weight_map.values()))
        files = [model_dir / n for n in names]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{index} names shards that are missing: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors files in {model_dir}")
    return files


def load_model(
    model_dir: str | Path,
    *,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> LlamaModel:
    """Build a :class:`LlamaModel` from a local folder. ``dtype`` defaults to the config's."""
    path = Path(model_dir)
    if not path.is_dir():
        if path.exists():
            raise ModelLoadError(
                f"{path} is a file, not a model folder (config.json, *.safetensors, tokenizer.json)"
            )
        raise ModelLoadError(f"model folder {path} does not exist")
    config = ModelConfig.from_file(path)
    target = parse_dtype(dtype if dtype is not None else _config_dtype(config))
    weights: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        try:
            part = load_file(str(file), device="cpu")
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc
        for name, tensor in part.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # recomputed from the config
            # clone: fresh, aligned memory instead of the file's memory map (matmuls on
            # unaligned mmap-backed tensors measured ~20x slower on CPU)
            weights[name] = tensor.to(device=device, dtype=target).clone()
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    logger.info("loaded %d tensors from %s (%s, %s)", len(weights), path, target, device)
    return LlamaModel(config, weights, device)


def _config_dtype(config: ModelConfig) -> str:
    name = config.torch_dtype.removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else "float32"
