"""``pagedkv router --model DIR`` tokenizes prompts without torch: the tokenizer code it shares
with the engine (``pagedkv.engine.tokenizer``) is torch-free and the engine package loads its
torch parts only when they are asked for. Checked in a fresh interpreter (``sys.modules``) and
on a real router process (no libtorch mapped after it tokenized a text and a chat prompt)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from e2e.processes import spawn, wait_ready
from pagedkv.engine.tiny import write_tiny_model

_CHECK = """
import sys
from pagedkv.router.app import build_router_app
from pagedkv.router.cli import build_parser
from pagedkv.router.engines import EngineRegistry
from pagedkv.router.prompts import PromptTokenizer

tok = PromptTokenizer(sys.argv[1])
chat = tok.prompt_ids("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
text = tok.prompt_ids("/v1/completions", {"prompt": "hello world"})
assert chat and text, (chat, text)
build_router_app(EngineRegistry(["http://127.0.0.1:1"]), tokenizer=tok)
print("torch" in sys.modules)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_router_tokenizer_imports_no_torch(model_dir: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _CHECK, str(model_dir)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_router_process_with_a_model_never_loads_torch(model_dir: Path, tmp_path: Path) -> None:
    router = spawn(["router", "--model", str(model_dir), "--engine", "http://127.0.0.1:1"],
                   tmp_path / "router.log")  # fmt: skip
    try:
        wait_ready(router, "/router/stats")
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
        for path, body in (
            ("/v1/completions", {"model": "tiny", "prompt": "hello world"}),
            ("/v1/chat/completions", chat),
        ):
            resp = httpx.post(router.url + path, json=body, timeout=10)
            assert resp.status_code == 503  # tokenized, then no engine to route to
        maps = Path(f"/proc/{router.proc.pid}/maps").read_text()
        assert "libtorch" not in maps
        assert "tokenizers" in maps  # the tokenizer library did load
    finally:
        router.stop()
