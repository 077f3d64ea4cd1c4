"""``prefix_caching_hash_algo`` (vLLM's option): the engine's block hashes follow it, hits and
outputs do not change with it, and an unsupported value is refused by name (config and CLI)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedkv.core.hashing import HashAlgo, HashContext, hash_blocks
from pagedkv.engine.cli import generate_main
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.errors import InvalidRequestError

PROMPT = list(range(3, 40))
GREEDY = SamplingParams(max_tokens=5, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("algo") / "m")


def test_the_hash_follows_the_option_and_outputs_do_not(model_dir: Path) -> None:
    outs = {}
    for name, algo in (("sha256", HashAlgo.SHA256), ("xxhash", HashAlgo.XXH3_128)):
        llm = LLM(str(model_dir), block_size=4, num_blocks=64, prefix_caching_hash_algo=name)
        cfg = llm.engine.scheduler.manager.config
        assert cfg.hash_algo is algo
        first, again = (llm.generate([PROMPT], GREEDY, progress=False)[0] for _ in range(2))
        assert again.num_cached_tokens == 36
        ctx = HashContext(model_id=cfg.model_id, algo=algo)
        pool = llm.engine.scheduler.manager.pool
        assert all(pool.is_cached(h) for h in hash_blocks(PROMPT, 4, ctx))
        outs[name] = first.outputs[0].token_ids
    assert outs["sha256"] == outs["xxhash"]


def test_unsupported_values_are_refused(
    model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(InvalidRequestError, match="sha256_cbor"):
        EngineConfig(prefix_caching_hash_algo="sha256_cbor")
    with pytest.raises(SystemExit) as exit_info:
        generate_main([str(model_dir), "--prompt", "hi", "--prefix-caching-hash-algo", "md5"])
    assert exit_info.value.code == 2
    assert "--prefix-caching-hash-algo" in capsys.readouterr().err
