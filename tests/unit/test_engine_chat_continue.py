"""vLLM's chat extras: ``continue_final_message`` ends the prompt right after the final
message's content, and ``chat_template_kwargs`` reach the template, both rendered exactly as
transformers' ``apply_chat_template`` renders them; what cannot be honoured is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from pagedkv.engine.chat_encoding import encode_chat
from pagedkv.engine.chat_template import ChatTemplate
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import InvalidRequestError

THINKING = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}<|end|>"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}"
)
CHAT = [
    {"role": "user", "content": "Count to five."},
    {"role": "assistant", "content": "One, two, "},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cont") / "m")


def _pair(model_dir: Path, template: str | None = None) -> tuple[Tokenizer, Any]:
    tok = Tokenizer(model_dir)
    hf = PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )
    hf.chat_template = template or tok.chat_template.text  # type: ignore[union-attr]
    if template is not None:
        tok.chat_template = ChatTemplate(template, "test")
    return tok, hf


@pytest.mark.parametrize("template", [None, THINKING])
def test_continue_final_message_renders_as_transformers(
    model_dir: Path, template: str | None
) -> None:
    tok, hf = _pair(model_dir, template)
    text = hf.apply_chat_template(
        CHAT, tokenize=False, add_generation_prompt=False, continue_final_message=True
    )
    ids = encode_chat(tok, CHAT, add_generation_prompt=False, continue_final_message=True)
    assert ids == tok.encode(text, add_special_tokens=False)
    assert text.endswith("One, two," if template else "One, two, ")  # THINKING trims it
    plain = encode_chat(tok, CHAT, add_generation_prompt=False)
    assert len(ids) < len(plain)  # the end-of-turn marker is gone


def test_continue_final_message_with_a_special_token_typed_in_it(model_dir: Path) -> None:
    tok, _ = _pair(model_dir)
    chat = [CHAT[0], {"role": "assistant", "content": "a <|end|> b"}]
    ids = encode_chat(tok, chat, add_generation_prompt=False, continue_final_message=True)
    assert ids[-len(tok.encode_plain("a <|end|> b")) :] == tok.encode_plain("a <|end|> b")


def test_chat_template_kwargs_reach_the_template(model_dir: Path) -> None:
    tok, hf = _pair(model_dir, THINKING)
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, {}):
        text = hf.apply_chat_template(
            CHAT[:1], tokenize=False, add_generation_prompt=True, **kwargs
        )
        ids = encode_chat(tok, CHAT[:1], chat_template_kwargs=kwargs)
        assert ids == tok.encode(text, add_special_tokens=False)
    off = encode_chat(tok, CHAT[:1], chat_template_kwargs={"enable_thinking": False})
    assert off != encode_chat(tok, CHAT[:1])


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"continue_final_message": True}, "cannot both be true"),
        ({"chat_template_kwargs": {"messages": []}}, "may not set messages"),
        ({"chat_template_kwargs": {"bos_token": "x"}}, "may not set bos_token"),
        ({"chat_template_kwargs": {"x": ["<|end|>"]}}, "special token"),
        ({"chat_template_kwargs": {"<|end|>": 1}}, "special token"),
    ],
)
def test_what_cannot_be_honoured_is_refused(
    model_dir: Path, kwargs: dict[str, Any], match: str
) -> None:
    tok, _ = _pair(model_dir)
    with pytest.raises(InvalidRequestError, match=match):
        encode_chat(tok, CHAT, **kwargs)


@pytest.mark.parametrize("last", [{"role": "assistant", "content": "  "}, {"role": "user"}])
def test_continue_needs_a_final_text(model_dir: Path, last: dict[str, Any]) -> None:
    tok, _ = _pair(model_dir)
    with pytest.raises(InvalidRequestError, match="final message"):
        encode_chat(tok, [CHAT[0], last], add_generation_prompt=False, continue_final_message=True)


def test_llm_chat_continues_the_final_message(model_dir: Path) -> None:
    llm = LLM(str(model_dir), block_size=4, num_blocks=128, max_model_len=128)
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    (out,) = llm.chat(
        CHAT, greedy, add_generation_prompt=False, continue_final_message=True, progress=False
    )
    tok = llm.tokenizer
    want = encode_chat(tok, CHAT, add_generation_prompt=False, continue_final_message=True)
    assert list(out.prompt_token_ids) == want
    (alias,) = llm.chat(  # vLLM's keyword names reach generate
        CHAT, sampling_params=greedy, use_tqdm=False, add_generation_prompt=False,
        continue_final_message=True,
    )  # fmt: skip
    assert alias.outputs[0].token_ids == out.outputs[0].token_ids
