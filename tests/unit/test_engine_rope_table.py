"""The RoPE cos/sin table (``LlamaModel._grow_rope_table``): every entry is the float64 cos or
sin of transformers' float32 angle, rounded once, whatever ran in the process before and
however the table grew. torch's float32 ``cos`` broke this: after float64 work in the process
one thread's half of a chunk came out up to 1.5e-4 off, so the first of two engines in one
process sometimes built a different table (and, under ``medium``, other outputs)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from pagedkv.engine.loader import load_model
from pagedkv.engine.tiny import write_tiny_model

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("rope") / "m", hidden_size=128, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=1, max_position_embeddings=4096,
    )  # fmt: skip


def _float64_work() -> None:
    """What preceded the failures: multi-threaded float64 matmuls and softmaxes."""
    x = torch.randn(9, 300, 64, dtype=torch.float64)
    s = x @ x.transpose(1, 2)
    s.masked_fill(torch.triu(torch.ones(300, 300, dtype=torch.bool), 1), float("-inf")).softmax(-1)


def test_the_table_is_float64_trig_rounded_once_in_any_process(model_dir: Path) -> None:
    _float64_work()
    models = [load_model(model_dir) for _ in range(2)]
    models[0]._grow_rope_table(2048)
    for n in (256, 700, 2048):  # the second grows in steps
        models[1]._grow_rope_table(n)
    for m in models:
        pos = torch.arange(2048, dtype=torch.float32)
        freqs = (pos[:, None] * m._inv_freq[None, :]).numpy().astype(np.float64)
        angles = np.concatenate([freqs, freqs], axis=1)
        assert torch.equal(m._rope_cos[:2048], torch.from_numpy(np.cos(angles).astype(np.float32)))
        assert torch.equal(m._rope_sin[:2048], torch.from_numpy(np.sin(angles).astype(np.float32)))
    assert torch.equal(models[0]._rope_cos[:2048], models[1]._rope_cos[:2048])
