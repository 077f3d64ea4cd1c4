"""``pagedkv generate`` / ``serve`` as vLLM users call them: flag names, the pool sized in bytes,
the context length, exit codes (2 usage, 1 runtime), stderr, the port checked first."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedkv.cli import main as pagedkv_main
from pagedkv.engine.cli import generate_main
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.model_args import add_model_arguments, engine_config, model_path
from pagedkv.engine.startup import startup_line
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.errors import InvalidRequestError
from pagedkv.server import cli as serve_cli


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("cli") / "m", max_position_embeddings=8192)


@pytest.fixture
def keep_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _parse(argv: list[str]) -> tuple[str, EngineConfig]:
    parser = serve_cli.build_parser()
    args = parser.parse_args(argv)
    return model_path(parser, args), engine_config(parser, args)


def test_vllm_names_build_the_same_config_as_pagedkvs(model: Path) -> None:
    vllm_style = [
        str(model),
        "--no-enable-prefix-caching",
        "--kv-cache-memory-bytes",
        "1M",
        "--dtype",
        "auto",
        "--tokenizer",
        str(model),
        "--chat-template",
        "{{ 1 }}",
        "--seed",
        "5",
        "--max-model-len",
        "1000",
        "--num-speculative-tokens",
        "2",
    ]
    path, cfg = _parse(vllm_style)
    assert path == str(model)
    assert cfg.enable_prefix_caching is False
    assert cfg.kv_cache_bytes == 1 << 20
    assert (cfg.tokenizer, cfg.chat_template, cfg.seed) == (str(model), "{{ 1 }}", 5)
    assert (cfg.max_model_len, cfg.num_speculative_tokens) == (1000, 2)
    legacy = ["--model", str(model), "--no-prefix-caching", "--speculative-tokens", "2"]
    _, old = _parse(legacy)
    assert old.enable_prefix_caching is False
    assert old.num_speculative_tokens == 2
    _, default = _parse([str(model)])
    assert default.enable_prefix_caching is True
    assert default.dtype == "auto"


def test_pool_in_bytes_derives_blocks_and_context_is_the_models_own(model: Path) -> None:
    _, cfg = _parse([str(model), "--kv-cache-memory-bytes", "1M", "--block-size", "16"])
    engine = LLMEngine.from_model_dir(str(model), cfg)
    # 2 (K and V) x 2 layers x 2 KV heads x head_dim 16 x 16 tokens x 4 bytes = 8 KiB per block
    assert engine.scheduler.manager.pool.num_blocks == (1 << 20) // (2 * 2 * 2 * 16 * 16 * 4)
    assert engine.max_model_len == 8192  # max_position_embeddings, not capped at 4096
    line = startup_line(engine, str(model))
    for part in (
        "(llama, xxh3-128:",
        "dtype float32",
        "context 8192 tokens",
        "KV pool 128 blocks x 16 = 2032 tokens, 0.000977 GiB",
        "chat template tokenizer_config.json",
        "tiers: none",
    ):
        assert part in line
    _, too_long = _parse([str(model), "--max-model-len", "9000"])
    with pytest.raises(InvalidRequestError, match="exceeds the model's max_position_embeddings"):
        LLMEngine.from_model_dir(str(model), too_long)


@pytest.mark.parametrize("command", [generate_main, serve_cli.main])
def test_usage_errors_exit_2_on_stderr(
    model: Path, command: object, capsys: pytest.CaptureFixture[str]
) -> None:
    extra = ["--prompt", "x"] if command is generate_main else []
    bad = [
        [str(model), "--frobnicate", *extra],  # unknown flag
        [str(model), "--dtype", "half", *extra],  # not a choice
        [str(model), "--kv-cache-memory-bytes", "lots", *extra],
        [str(model), "--num-blocks", "8", "--kv-cache-memory-bytes", "1M", *extra],
        [str(model), "--model", str(model / "other"), *extra],  # the model given twice
        [*extra],  # no model
        [str(model), "--block-size", "0", *extra],
        [str(model), "--disk-tier", "/tmp/x", *extra],  # no budget: EngineConfig rejects it
    ]
    if command is serve_cli.main:
        bad += [[str(model), "--log-level", "loud"], [str(model), "--port", "70000"]]
    for argv in bad:
        with pytest.raises(SystemExit) as info:
            command(argv)  # type: ignore[operator]
        assert info.value.code == 2, argv
        captured = capsys.readouterr()
        assert captured.out == ""
        assert "error:" in captured.err


def test_runtime_failures_exit_1_and_a_file_is_not_called_missing(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert generate_main([str(tmp_path / "none"), "--prompt", "x"]) == 1
    assert "does not exist" in capsys.readouterr().err
    a_file = model / "config.json"
    assert generate_main([str(a_file), "--prompt", "x"]) == 1
    err = capsys.readouterr().err
    assert "is a file, not a model folder" in err
    assert "does not exist" not in err
    assert pagedkv_main(["serve", str(tmp_path / "none"), "--port", "0"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_serve_checks_its_port_before_loading_the_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        t0 = time.perf_counter()
        # the model does not exist: an error about the port proves it was checked first
        rc = serve_cli.main([str(tmp_path / "none"), "--port", str(port)])
        assert time.perf_counter() - t0 < 5
    err = capsys.readouterr().err
    assert rc == 1
    assert f"cannot listen on 127.0.0.1:{port}" in err
    assert "does not exist" not in err


def test_generate_threads_verbose_and_output_streams(
    model: Path, capsys: pytest.CaptureFixture[str], keep_threads: None
) -> None:
    argv = [str(model), "--prompt", "hello", "--max-tokens", "3", "--threads", "1", "-v"]
    assert generate_main(argv) == 0
    assert torch.get_num_threads() == 1
    captured = capsys.readouterr()
    assert "[0] " in captured.out  # the generated text: stdout
    assert "tokens/s" not in captured.out  # logs, the start-up line and timings: stderr
    assert "tokens/s" in captured.err
    assert "pagedkv: model " in captured.err
    log_lines = [line for line in captured.err.splitlines() if "pagedkv.engine.loader" in line]
    assert log_lines
    assert all(line.count("INFO") == 1 for line in log_lines)  # the level once


def test_generate_chat_with_an_inline_template(
    model: Path, capsys: pytest.CaptureFixture[str], keep_threads: None
) -> None:
    template = "<|user|>{{ messages[0]['content'] }}<|end|><|assistant|>"
    argv = [str(model), "--prompt", "hi", "--chat", "--chat-template", template]
    assert generate_main([*argv, "--max-tokens", "2", "--threads", "1"]) == 0
    assert "chat template --chat-template (inline)" in capsys.readouterr().err
    assert generate_main([*argv[:-1], str(model / "missing.jinja")]) == 1
    assert "neither a file nor a template" in capsys.readouterr().err


def test_version_and_parser_help_mention_vllm_names() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0
    assert proc.stdout.startswith("pagedkv 0.")
    import argparse

    parser = argparse.ArgumentParser()
    add_model_arguments(parser)
    text = parser.format_help()
    for flag in ("--enable-prefix-caching", "--kv-cache-memory-bytes", "--chat-template"):
        assert flag in text


def test_tokenizer_from_another_folder(model: Path, tmp_path: Path) -> None:
    bare = write_tiny_model(tmp_path / "bare")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (bare / name).unlink()
    _, cfg = _parse([str(bare)])
    assert LLMEngine.from_model_dir(str(bare), cfg).tokenizer is None
    _, cfg = _parse([str(bare), "--tokenizer", str(model)])
    engine = LLMEngine.from_model_dir(str(bare), cfg)
    assert engine.tokenizer is not None
    assert engine.tokenizer.encode("hello") == LLMEngine.from_model_dir(
        str(model),
        cfg,
    ).tokenizer.encode("hello")  # type: ignore[union-attr]
