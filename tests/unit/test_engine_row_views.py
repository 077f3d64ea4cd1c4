"""``row_views.joined_rows``: the rows of adjacent row ranges as one view, else a copy; and
the runner hands out a step's logits as adjacent ranges in the scheduler's order, so the
sampler reads them without a copy."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.row_views import adjacent_view, joined_rows
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 12),
    cols=st.integers(1, 5),
    cuts=st.lists(st.integers(0, 12), max_size=6),
    order=st.randoms(use_true_random=False),
    shuffle=st.booleans(),
)
def test_joined_rows_is_cat_and_a_view_exactly_when_adjacent(
    rows: int, cols: int, cuts: list[int], order: Any, shuffle: bool
) -> None:
    base = torch.randn(rows, cols)
    bounds = sorted({0, rows, *(c for c in cuts if c <= rows)})
    parts = [base[a:b] for a, b in itertools.pairwise(bounds)]
    if shuffle:
        order.shuffle(parts)
    got = joined_rows(parts)
    assert torch.equal(got, torch.cat(parts))
    view = adjacent_view(parts)
    assert (view is not None) == _shares(got, base)  # a view exactly when joined_rows shares
    assert view is None or torch.equal(view, got)
    in_order = all(
        p.storage_offset() + p.numel() == q.storage_offset() for p, q in itertools.pairwise(parts)
    )
    assert _shares(got, base) == (in_order or len(parts) == 1)


def test_joined_rows_copies_parts_of_different_tensors_or_layouts() -> None:
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    got = joined_rows([a, b])
    assert torch.equal(got, torch.cat([a, b]))
    assert not _shares(got, a)
    t = torch.randn(3, 4).t()  # rows of a transposed tensor are not contiguous
    got = joined_rows([t[0:2], t[2:4]])
    assert torch.equal(got, t)
    assert not _shares(got, t)
    x = torch.randn(4, 3)
    got = joined_rows([x[0:1], x[2:4]])  # a gap: row 1 is not a part
    assert torch.equal(got, x[[0, 2, 3]])
    assert not _shares(got, x)
    assert adjacent_view([a, b]) is None
    assert adjacent_view([x[0:1], x[2:4]]) is None
    assert adjacent_view([]) is None
    with pytest.raises(ValueError, match="non-empty"):  # as torch.cat
        joined_rows([])


@pytest.mark.engine
def test_the_runner_hands_out_adjacent_logits_in_the_scheduled_order(tmp_path: Path) -> None:
    """Prompts longest first: the runner sorts decodes shortest first for attention, yet the
    logits come back as adjacent row ranges of one tensor in the scheduler's order, and the
    sampler's joined view shares their memory; the tokens equal each prompt run alone."""
    model = write_tiny_model(tmp_path / "m", eos_token_id=None)
    cfg = EngineConfig(block_size=4, num_blocks=256, check_invariants=True)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    prompts = {f"r{i}": [3 + i, 9, 11, 5][: 4 - i % 3] * (6 - i) for i in range(5)}
    engine = LLMEngine.from_model_dir(str(model), cfg)
    real = engine.runner.execute
    seen: list[tuple[list[str], list[str], bool]] = []  # checked after: the step isolates raises

    def execute(batch: Any) -> dict[str, torch.Tensor]:
        out = real(batch)
        parts = list(out.values())
        order = [s.request_id for s in batch.scheduled if s.request_id in out]
        seen.append((order, list(out), _shares(joined_rows(parts), parts[0])))
        return out

    engine.runner.execute = execute  # type: ignore[method-assign]
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = list(o.outputs[0].token_ids)
    assert len(seen) == params.max_tokens
    assert all(len(o) == len(prompts) for o, _, _ in seen)
    assert all(order == handed for order, handed, _ in seen)
    assert all(shared for _, _, shared in seen)
    for rid, p in prompts.items():
        alone = LLMEngine.from_model_dir(str(model), cfg)
        alone.add_request(rid, p, params)
        while alone.has_unfinished_requests():
            for o in alone.step():
                if o.finished:
                    assert list(o.outputs[0].token_ids) == got[rid]
