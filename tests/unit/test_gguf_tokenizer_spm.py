"""A SentencePiece-style (``tokenizer.ggml.model == "llama"``) vocabulary in a GGUF file: the
tokenizer pagedkv rebuilds from it encodes and decodes like transformers' GGUF tokenizer
(merges recovered from scores, byte fallback, prefix space, special tokens, BOS)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pagedkv.engine.gguf_loader import GGUFFile
from pagedkv.engine.gguf_tokenizer import gguf_tokenizer
from pagedkv.engine.tiny import _CORPUS

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
from differential.gguf_files import write_tiny_gguf  # noqa: E402

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces,   runs   of spaces\nand a new line\n\n",
    "Ünïcödé 日本 🙂 falls back to bytes",
    "<s>special tokens</s> stay whole <unk>",
    "",
]


def _spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece BPE vocabulary laid out as llama.cpp writes Llama 2's: <unk>, <s>,
    </s>, the 256 byte tokens, then the pieces, each scored minus its merge rank."""
    from tokenizers import SentencePieceBPETokenizer

    trained = SentencePieceBPETokenizer(replacement="▁")
    trained.train_from_iterator(_CORPUS * 3, vocab_size=200, show_progress=False)
    vocab: dict[str, int] = json.loads(trained.to_str())["model"]["vocab"]
    pieces = [p for p, _ in sorted(vocab.items(), key=lambda kv: kv[1]) if p != "<unk>"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *pieces]
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    types = [2, 3, 3, *([6] * 256), *([1] * len(pieces))]
    return tokens, scores, types


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokens, scores, types = _spm_vocab()

    def add(w: Any) -> None:
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)

    path, _ = write_tiny_gguf(tmp_path_factory.mktemp("spm"), tokenizer=add)
    return path


def test_sentencepiece_vocab_encodes_and_decodes_like_transformers(gguf_path: Path) -> None:
    ours = gguf_tokenizer(GGUFFile.open(gguf_path).metadata)
    theirs = transformers.AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert ours is not None
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text), text
        assert ids[:1] == [1]  # llama vocabularies add BOS unless the file says otherwise
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
    assert len(ours.encode(TEXTS[0])) < len(TEXTS[0]) / 2  # the merges are in use
    assert ours.encode("🙂", add_special_tokens=False)[-4:] == [3 + b for b in "🙂".encode()]
