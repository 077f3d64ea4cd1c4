"""GGUF files written with gguf.GGUFWriter (the tiny random Llama, converted as llama.cpp does):
the loader gives the safetensors weights back exactly, generates the same tokens, refuses what it
cannot honour by name, and names the checkpoint by its content."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.engine.gguf_loader import (
    GGUFFile,
    gguf_fingerprint,
    is_gguf_file,
    load_gguf_checkpoint,
    load_gguf_model,
    unpermute_qk,
)
from pagedkv.engine.llm import LLM
from pagedkv.engine.loader import load_model
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import ModelLoadError

gguf = pytest.importorskip("gguf")
from differential.gguf_files import converter_permute, write_tiny_gguf  # noqa: E402

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_unpermute_inverts_the_converters_permutation() -> None:
    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    back = unpermute_qk(torch.from_numpy(converter_permute(w, 8)), 8)
    assert torch.equal(back, torch.from_numpy(w))
    bias = np.arange(4 * 16, dtype=np.float32)
    back_bias = unpermute_qk(torch.from_numpy(converter_permute(bias, 4)), 4)
    assert torch.equal(back_bias, torch.from_numpy(bias))


def test_f32_gguf_gives_back_the_safetensors_weights_exactly(tmp_path: Path) -> None:
    path, hf = write_tiny_gguf(tmp_path)
    assert is_gguf_file(path)
    assert not is_gguf_file(hf / "model.safetensors")
    ours, ref = load_gguf_model(path), load_model(hf)
    # GGUF stores eps as float32: the same float32 the model adds, a different Python float
    assert ours.config.rms_norm_eps == pytest.approx(ref.config.rms_norm_eps, rel=1e-6)
    assert replace(ours.config, rms_norm_eps=ref.config.rms_norm_eps) == ref.config
    assert sorted(ours.weights) == sorted(ref.weights)
    for name, tensor in ref.weights.items():
        assert torch.equal(ours.weights[name], tensor), name


@pytest.mark.parametrize("arch", ["mistral", "qwen2", "qwen3"])
def test_other_architectures_load_with_their_q_k_layout(tmp_path: Path, arch: str) -> None:
    """mistral's Q/K rows are permuted like llama's; qwen2/qwen3's are stored as in HF."""
    path, hf = write_tiny_gguf(tmp_path, arch=arch)
    ours, ref = load_gguf_model(path), load_model(hf)
    assert ours.config.model_type == arch
    for name, tensor in ref.weights.items():
        assert torch.equal(ours.weights[name], tensor), name


def test_q8_0_gguf_weights_are_the_dequantized_values(tmp_path: Path) -> None:
    path, hf = write_tiny_gguf(tmp_path, tensor_type="Q8_0")
    ours, ref = load_gguf_model(path), load_model(hf)
    for name, tensor in ref.weights.items():
        err = (ours.weights[name] - tensor).abs().max().item()
        scale = tensor.abs().max().item()
        assert err <= scale / 127 + 1e-6, name  # Q8_0: half a step of absmax/127 per block


def test_gguf_and_safetensors_generate_the_same_tokens(tmp_path: Path) -> None:
    path, hf = write_tiny_gguf(tmp_path)
    prompts = ["The quick brown fox", "Paged attention stores keys", "hello there!"]
    ours = LLM(str(path), enable_prefix_caching=True)
    ref = LLM(str(hf))
    got = [o.outputs[0].token_ids for o in ours.generate(prompts, GREEDY, progress=False)]
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, GREEDY, progress=False)]
    assert got == want
    # the cache namespace / hash root is the file's content hash, not its path
    assert ours.engine.config.model_id == gguf_fingerprint(GGUFFile.open(path))
    assert str(path) not in ours.engine.config.model_id


def test_tokenizer_from_gguf_metadata_matches_the_folders_tokenizer(tmp_path: Path) -> None:
    path, hf = write_tiny_gguf(tmp_path)
    ours = load_gguf_checkpoint(path).tokenizer
    ref = Tokenizer(hf)
    assert ours is not None
    text = "<s>Hello  there!\n\n  Paged attention — «blocks» 🙂 <|user|>hi<|end|>"
    assert ours.encode(text) == ref.encode(text)
    ids = ref.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    msgs = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs)
    assert ours.chat_template is not None  # the start-up line names the file's metadata
    assert ours.chat_template.source == "GGUF tokenizer.chat_template"
    assert (ours.bos_token, ours.eos_token) == ("<s>", "</s>")


def test_add_bos_token_prepends_bos(tmp_path: Path) -> None:
    path, _ = write_tiny_gguf(tmp_path, add_bos=True)
    tok = load_gguf_checkpoint(path).tokenizer
    assert tok is not None
    bos = tok.encode("<s>", add_special_tokens=False)
    assert tok.encode("hello")[:1] == bos
    assert tok.encode("hello", add_special_tokens=False)[:1] != bos


def test_fingerprint_follows_content_not_path(tmp_path: Path) -> None:
    path, _ = write_tiny_gguf(tmp_path / "a")
    copy = tmp_path / "elsewhere.gguf"
    shutil.copy(path, copy)
    fp = gguf_fingerprint(GGUFFile.open(path))
    assert fp == gguf_fingerprint(GGUFFile.open(copy))
    data = bytearray(copy.read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    copy.write_bytes(bytes(data))
    assert gguf_fingerprint(GGUFFile.open(copy)) != fp


def test_unsupported_architecture_is_refused_by_name(tmp_path: Path) -> None:
    path, _ = write_tiny_gguf(tmp_path, arch="gemma")
    with pytest.raises(ModelLoadError, match="'gemma'"):
        load_gguf_model(path)


def test_unsupported_tensor_type_is_refused_by_name(tmp_path: Path) -> None:
    q2k = gguf.GGMLQuantizationType.Q2_K
    raw = np.zeros((4, 84), dtype=np.uint8)  # 4 rows of one 256-value Q2_K block
    path, _ = write_tiny_gguf(tmp_path, raw_tensors={"output.weight": (raw, q2k)})
    with pytest.raises(ModelLoadError, match="Q2_K"):
        load_gguf_model(path)


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("llama.attention.sliding_window", 64, "sliding-window"),
        ("llama.expert_count", 8, "mixture-of-experts"),
        ("llama.rope.scaling.type", "yarn", "yarn"),
        ("llama.rope.dimension_count", 8, "partial rotary"),
    ],
)
def test_metadata_the_engine_cannot_honour_is_refused(
    tmp_path: Path, key: str, value: object, named: str
) -> None:
    path, _ = write_tiny_gguf(tmp_path, extra_kv={key: value})
    with pytest.raises(ModelLoadError, match=named):
        load_gguf_model(path)


def test_unknown_pre_tokenizer_is_refused_by_name(tmp_path: Path) -> None:
    path, _ = write_tiny_gguf(tmp_path, pre="some-new-bpe")
    with pytest.raises(ModelLoadError, match="some-new-bpe"):
        load_gguf_checkpoint(path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        GGUFFile.open(bad)
    truncated = tmp_path / "cut.gguf"
    path, _ = write_tiny_gguf(tmp_path / "t")
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ModelLoadError, match="cannot read GGUF"):
        GGUFFile.open(truncated)
    truncated.write_bytes(path.read_bytes()[:-100])  # the last tensor's data cut short
    with pytest.raises(ModelLoadError, match="truncated or corrupt"):
        GGUFFile.open(truncated)
