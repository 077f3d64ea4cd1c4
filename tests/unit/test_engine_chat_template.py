"""Chat templates as checkpoints ship them, rendered exactly as transformers renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from pagedkv.engine.chat_template import (
    ChatTemplate,
    find_chat_template,
    load_chat_template,
    render_chat_template,
)
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import CHAT_TEMPLATE, write_tiny_model
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import InvalidRequestError, ModelLoadError

# strftime_now, {% break %} / {% continue %}, tojson (non-ASCII kept, indent), raise_exception,
# special tokens as variables, trim_blocks/lstrip_blocks, a namespace
RICH_TEMPLATE = """{{ bos_token }}Today: {{ strftime_now("%Y-%m-%d") }}
{% set ns = namespace(n=0) %}
{% for m in messages %}
    {% if m['role'] == 'tool' %}{% continue %}{% endif %}
    {% if ns.n >= 3 %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    {% if m['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('bad role ' + m['role']) }}
    {% endif %}
<|{{ m['role'] }}|>{{ m['content'] | tojson }}{{ eos_token }}
{% endfor %}
{% if tools %}{{ tools | tojson(indent=2) }}{% endif %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "Réponds en français, s'il te plaît. 日本語も"},
    {"role": "tool", "content": "skipped by continue"},
    {"role": "user", "content": 'Qu\'est-ce que "ß" et «ü»? 🙂'},
    {"role": "assistant", "content": "Ça va."},
    {"role": "user", "content": "cut by break"},
]


def _hf_tokenizer(model_dir: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_file=str(model_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>"
    )


def _save_pretrained_folder(tmp_path: Path, template: str) -> Path:
    """A model folder whose tokenizer files transformers' save_pretrained wrote."""
    model = write_tiny_model(tmp_path / "m")
    (model / "tokenizer_config.json").unlink()
    hf = _hf_tokenizer(model)
    hf.chat_template = template
    hf.save_pretrained(str(model))
    return model


def test_save_pretrained_folder_keeps_the_template_in_chat_template_jinja(
    tmp_path: Path,
) -> None:
    model = _save_pretrained_folder(tmp_path, RICH_TEMPLATE)
    assert (model / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((model / "tokenizer_config.json").read_text())
    tok = Tokenizer(model)
    assert tok.chat_template is not None
    assert tok.chat_template.source == "chat_template.jinja"
    assert tok.chat_template.text == RICH_TEMPLATE


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rich_template_renders_exactly_like_transformers(
    tmp_path: Path, add_generation_prompt: bool
) -> None:
    model = _save_pretrained_folder(tmp_path, RICH_TEMPLATE)
    hf = PreTrainedTokenizerFast.from_pretrained(str(model))
    tools = [{"type": "function", "function": {"name": "météo", "description": "天気"}}]
    expected = hf.apply_chat_template(
        MESSAGES, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    ours = Tokenizer(model).apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt, tools=tools
    )
    assert ours == expected
    # the properties the comparison is about, so the test cannot pass on an empty render
    assert "français" in ours
    assert "日本語" in ours  # tojson kept non-ASCII
    assert "skipped by continue" not in ours
    assert "cut by break" not in ours
    assert '\n  {\n    "type": "function"' in ours  # tojson(indent=2)
    assert ours.startswith("<s>Today: 20")


def test_raise_exception_is_an_invalid_request(tmp_path: Path) -> None:
    model = _save_pretrained_folder(tmp_path, RICH_TEMPLATE)
    with pytest.raises(InvalidRequestError, match="bad role developer"):
        Tokenizer(model).apply_chat_template([{"role": "developer", "content": "x"}])


def test_sources_in_transformers_order(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m")
    found = find_chat_template(model)
    assert found == ChatTemplate(CHAT_TEMPLATE, "tokenizer_config.json")
    (model / "chat_template.json").write_text(json.dumps({"chat_template": "json {{ 1 }}"}))
    assert find_chat_template(model) == ChatTemplate("json {{ 1 }}", "chat_template.json")
    (model / "chat_template.jinja").write_text("jinja {{ 2 }}")
    assert find_chat_template(model) == ChatTemplate("jinja {{ 2 }}", "chat_template.jinja")


def test_named_templates_take_default_and_a_folder_without_any_has_none(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m")
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D{{ 1 }}"}]
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    assert find_chat_template(model) == ChatTemplate("D{{ 1 }}", "tokenizer_config.json")
    (model / "tokenizer_config.json").write_text("{}")
    assert find_chat_template(model) is None
    with pytest.raises(InvalidRequestError, match="--chat-template"):
        Tokenizer(model).apply_chat_template([{"role": "user", "content": "x"}])


def test_unreadable_template_file_is_a_load_error(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m")
    (model / "chat_template.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"chat_template\.json"):
        find_chat_template(model)


def test_chat_template_option_reads_a_file_or_an_inline_template(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("F{{ messages[0]['content'] }}")
    assert load_chat_template(path) == ChatTemplate("F{{ messages[0]['content'] }}", str(path))
    inline = load_chat_template("{% for m in messages %}[{{ m['content'] }}]\\n{% endfor %}")
    assert "]\n{%" in inline.text  # the typed backslash-n is a newline, as in vLLM
    msgs = [{"role": "user", "content": "é"}]
    assert render_chat_template(inline, msgs) == "[é]\n"
    as_json = tmp_path / "tokenizer_config.json"
    as_json.write_text(json.dumps({"chat_template": "J{{ 1 }}"}))
    assert load_chat_template(as_json) == ChatTemplate("J{{ 1 }}", str(as_json))
    as_json.write_text("{}")
    with pytest.raises(InvalidRequestError, match="has no chat_template entry"):
        load_chat_template(as_json)
    with pytest.raises(InvalidRequestError, match="neither a file nor a template"):
        load_chat_template(tmp_path / "missing.jinja")
    with pytest.raises(ModelLoadError, match="does not compile"):
        render_chat_template(load_chat_template("{% for %}"), msgs)


def test_llm_chat_template_replaces_the_checkpoints(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "m")
    template = "<|user|>{{ messages[-1]['content'] }}<|end|><|assistant|>"
    with LLM(str(model), chat_template=template, num_blocks=64) as llm:
        tok = llm.tokenizer
        assert tok.chat_template.source == "--chat-template (inline)"
        text = tok.apply_chat_template([{"role": "user", "content": "hello"}])
        assert text == "<|user|>hello<|end|><|assistant|>"
        out = llm.generate(
            [tok.encode(text, add_special_tokens=False)],
            SamplingParams(max_tokens=3, temperature=0.0),
            progress=False,
        )
        assert len(out[0].outputs[0].token_ids) >= 1


def test_llm_chat_equals_generate_on_the_encoded_conversation(tmp_path: Path) -> None:
    from pagedkv.engine.chat_encoding import encode_chat

    model = write_tiny_model(tmp_path / "m")
    convs = [
        [{"role": "user", "content": "hello"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a <|end|> b"}],
    ]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    with LLM(str(model), num_blocks=64) as llm:
        tok = llm.tokenizer
        want = llm.generate([encode_chat(tok, c) for c in convs], greedy, progress=False)
        got = llm.chat(convs, greedy, progress=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert list(got[1].prompt_token_ids) == encode_chat(tok, convs[1])
        one = llm.chat(convs[0], greedy, progress=False)  # one conversation, not a list
        assert one[0].outputs[0].token_ids == want[0].outputs[0].token_ids
        parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
        with pytest.raises(InvalidRequestError, match="content parts"):
            llm.chat(parts, greedy, progress=False)
        with pytest.raises(InvalidRequestError, match="'role'"):
            llm.chat([{"content": "no role"}], greedy, progress=False)
