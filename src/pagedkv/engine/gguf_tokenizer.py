"""A tokenizer rebuilt from a GGUF file's metadata with the ``tokenizers`` library.

Two vocabularies, as llama.cpp names them in ``tokenizer.ggml.model``:

- ``gpt2``: byte-level BPE from ``tokens`` + ``merges``; the text is split before merging the way
  the vocabulary was trained, chosen by ``tokenizer.ggml.pre`` (table ``_SPLITS``; an unknown
  pre-tokenizer is refused rather than guessed, because a wrong split changes token ids).
- ``llama``: SentencePiece-style BPE with byte fallback; its merges are recovered from the
  pieces' ``scores`` (a piece that is the concatenation of two pieces merges them, best score
  first), ``▁`` marks spaces, a prefix space per ``add_space_prefix``.

Token types CONTROL (and UNKNOWN) become special tokens, USER_DEFINED plain added tokens (both
matched whole); ``add_bos_token``/``add_eos_token`` become the post-processor; bos/eos and the
chat template go to the same tokenizer_config keys a Hugging Face folder holds. The result is the
engine's :class:`Tokenizer`, so templates and detokenization behave as for any folder.
"""

from __future__ import annotations

import json
import logging
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from pagedkv.engine.chat_template import ChatTemplate
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import ModelLoadError

logger = logging.getLogger(__name__)

_CONTROL, _USER_DEFINED, _UNKNOWN = 3, 4, 2  # llama.cpp's token types
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (regex splits applied in order; llama.cpp's lists for these types)
_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "refact": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "llama3": (_LLAMA3_SPLIT,),
    "llama-v3": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
    "deepseek-r1-qwen": (_QWEN2_SPLIT,),
}
_IGNORE_MERGES = ("llama-bpe", "llama3", "llama-v3")  # as their tokenizer.json files say


def gguf_tokenizer(meta: Mapping[str, Any]) -> Tokenizer | None:
    """The engine tokenizer for GGUF metadata ``meta``; None when the file has no vocabulary.
    Raises ModelLoadError for a tokenizer model or pre-tokenizer it cannot rebuild exactly."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None or "tokenizer.ggml.tokens" not in meta:
        return None
    backend, add_bos = build_backend(meta)
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    config: dict[str, Any] = {"add_bos_token": add_bos}
    for name in ("bos", "eos", "unk", "pad"):
        token_id = meta.get(f"tokenizer.ggml.{name if name != 'unk' else 'unknown'}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            config[f"{name}_token"] = tokens[int(token_id)]
    template = meta.get("tokenizer.chat_template")
    if isinstance(template, str):
        config["chat_template"] = template
    return _wrap(backend, config)


def build_backend(meta: Mapping[str, Any]) -> tuple[HFTokenizer, bool]:
    """The ``tokenizers`` object and whether it adds BOS (``add_bos_token``)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if kind == "gpt2":
        tok = _byte_level_bpe(meta, tokens)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        tok = _sentencepiece_bpe(meta, tokens)
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise ModelLoadError(
            f"unsupported GGUF tokenizer tokenizer.ggml.model={kind!r}; supported: gpt2, llama"
        )
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty in (_CONTROL, _UNKNOWN)
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, ty in zip(tokens, types, strict=True)
        if ty == _USER_DEFINED
    ]
    tok.add_special_tokens(special)
    tok.add_tokens(user)
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    post = _post_processor(meta, tokens, add_bos=add_bos, add_eos=add_eos)
    if post is not None:
        tok.post_processor = post
    return tok, add_bos


def _byte_level_bpe(meta: Mapping[str, Any], tokens: Sequence[str]) -> HFTokenizer:
    pre = meta.get("tokenizer.ggml.pre")
    if pre is None:
        logger.warning("GGUF gives no tokenizer.ggml.pre; splitting text as GPT-2 does")
        pre = "gpt2"
    if pre not in _SPLITS:
        raise ModelLoadError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={pre!r}; "
            f"supported: {', '.join(sorted(_SPLITS))}"
        )
    merges_raw = meta.get("tokenizer.ggml.merges")
    if not isinstance(merges_raw, list):
        raise ModelLoadError("a gpt2-style GGUF tokenizer needs tokenizer.ggml.merges")
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    vocab = {t: i for i, t in enumerate(tokens)}
    model = models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES)
    tok = HFTokenizer(model)
    splits: list[Any] = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _SPLITS[pre]]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    if pre in ("qwen2", "deepseek-r1-qwen"):
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_bpe(meta: Mapping[str, Any], tokens: Sequence[str]) -> HFTokenizer:
    scores_raw = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores_raw, list) or len(scores_raw) != len(tokens):
        raise ModelLoadError("a llama-style GGUF tokenizer needs one score per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    model = models.BPE(
        vocab,
        sentencepiece_merges(tokens, [float(s) for s in scores_raw]),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = HFTokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps: list[Any] = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def sentencepiece_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a piece into two pieces of
    the vocabulary, ranked by the merged piece's score (higher first), then by the parts' ids.
    O(sum of piece lengths) lookups."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                ranked.append((-score, ids[left], ids[right], left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _post_processor(
    meta: Mapping[str, Any], tokens: Sequence[str], *, add_bos: bool, add_eos: bool
) -> Any:
    pieces: list[tuple[str, int]] = []
    for name, wanted in (("bos", add_bos), ("eos", add_eos)):
        token_id = meta.get(f"tokenizer.ggml.{name}_token_id")
        if wanted:
            if token_id is None:
                raise ModelLoadError(f"add_{name}_token is set but the GGUF names no {name} token")
            pieces.append((tokens[int(token_id)], int(token_id)))
    if not pieces:
        return None
    bos = [p for p, _ in pieces[:1]] if add_bos else []
    eos = [pieces[-1][0]] if add_eos else []
    single = " ".join([*bos, "$A", *eos])
    pair = " ".join([*bos, "$A", *eos, *bos, "$B", *eos])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=pieces)


GGUF_TEMPLATE_SOURCE = "GGUF tokenizer.chat_template"  # where the start-up line says it came from


def _wrap(backend: HFTokenizer, config: Mapping[str, Any]) -> Tokenizer:
    """The engine's Tokenizer over ``backend``: materialised as the two files of a Hugging Face
    folder (tokenizer.json, tokenizer_config.json) in a temporary folder, so a GGUF tokenizer
    goes through exactly the code path (templates, special tokens) of any other model."""
    with tempfile.TemporaryDirectory(prefix="pagedkv-gguf-tok-") as tmp:
        folder = Path(tmp)
        backend.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
        text = config.get("chat_template")
        template = ChatTemplate(text, GGUF_TEMPLATE_SOURCE) if isinstance(text, str) else None
        return Tokenizer(folder, chat_template=template)
