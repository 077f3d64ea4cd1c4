"""``n`` up to what the pool holds: more samples than ``max_num_seqs`` or than the KV pool can
run at once queue and all finish (no hang); ``n`` over the server's limit is a 400 naming ``n``
and the limit."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from e2e.server_fixtures import MODEL_NAME, running_server, write_endless_model
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.server.schemas import MAX_N

pytestmark = pytest.mark.engine


@pytest.mark.parametrize(
    ("max_num_seqs", "num_blocks"),
    [(2, 64), (64, 6)],  # 12 samples, 1 block each (13 tokens): 2 run at once / ~5 fit at once
    ids=["seqs", "blocks"],
)
def test_more_samples_than_seqs_or_blocks_queue_and_finish(
    tmp_path: Path, max_num_seqs: int, num_blocks: int
) -> None:
    model = write_endless_model(tmp_path / "m")
    cfg = EngineConfig(max_num_seqs=max_num_seqs, num_blocks=num_blocks, block_size=16)
    with (
        running_server(model, config=cfg) as srv,
        openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60) as oc,
    ):
        for stream in (False, True):
            kw = {"model": MODEL_NAME, "prompt": "a b c", "max_tokens": 10, "n": 12, "seed": 3}
            if stream:
                finish: dict[int, str] = {}
                for chunk in oc.completions.create(**kw, stream=True):  # type: ignore[call-overload]
                    for c in chunk.choices:
                        if c.finish_reason:
                            finish[c.index] = c.finish_reason
                assert finish == dict.fromkeys(range(12), "length")
            else:
                resp = oc.completions.create(**kw)  # type: ignore[call-overload]
                assert sorted(c.index for c in resp.choices) == list(range(12))
                assert all(c.finish_reason == "length" for c in resp.choices)
                assert resp.usage is not None
                assert resp.usage.completion_tokens == 12 * 10
            srv.wait_idle()
            srv.check_invariants()


def test_n_over_the_limit_is_a_400_naming_n_and_the_limit(tmp_path: Path) -> None:
    model = write_endless_model(tmp_path / "m")
    with (
        running_server(model) as srv,
        openai.OpenAI(base_url=srv.v1, api_key="unused", max_retries=0, timeout=60) as oc,
    ):
        with pytest.raises(openai.BadRequestError, match=rf"n: .*{MAX_N}") as err:
            oc.completions.create(model=MODEL_NAME, prompt="a", max_tokens=1, n=MAX_N + 1)
        assert err.value.body is not None
        assert err.value.body["param"] == "n"  # type: ignore[index]
