"""The simulator's compact storage: finished requests in typed columns (RequestRecords), token
usage rebuilt from stored empty slots, outputs drawn as 8-byte arrays. Each must read back
exactly what the object-per-request storage held."""

from __future__ import annotations

import copy
import pickle
from array import array

import numpy as np
import pytest

from pagedkv.core.config import CacheConfig
from pagedkv.sched.config import SchedulerConfig
from pagedkv.sim import RequestRecord, SimConfig, make_workload, simulate
from pagedkv.sim.recorder import Recorder
from pagedkv.sim.records import RequestRecords
from pagedkv.sim.tracks import output_tokens
from pagedkv.sim.workload import (
    EOS_TOKEN_ID,
    VOCAB_HIGH,
    VOCAB_LOW,
    SimRequest,
    Workload,
    stable_seed,
)


def _two_requests() -> RequestRecords:
    reqs = (
        SimRequest("a", 0.0, (1, 2, 3), 4, session_id="s", tag="chat"),
        SimRequest("b", 1.0, (4,), 2),
    )
    rows = RequestRecords(reqs)
    rows.append(1, 1.0, None, None, (1, 0, 0, 0), rejected=True)
    rows.append(0, 0.0, 0.25, 0.75, (3, 4, 2, 1))
    return rows


def test_rows_read_back_as_the_records_they_stand_for() -> None:
    rows = _two_requests()
    want = (
        RequestRecord("b", "", "", 1.0, None, None, 1, 0, 0, 0, rejected=True),
        RequestRecord("a", "s", "chat", 0.0, 0.25, 0.75, 3, 4, 2, 1),
    )
    assert len(rows) == 2
    assert tuple(rows) == want
    assert rows == want
    assert want == rows
    assert list(rows) == list(want)
    assert (rows[-1], rows[1:]) == (want[1], want[1:])
    with pytest.raises(IndexError, match="record 2 of 2"):
        rows[2]
    assert rows.tag_totals() == {"chat": [1, 3, 2]}  # the rejected request is not admitted
    assert rows != want[:1]
    assert sum(c.itemsize for c in _columns(rows)) <= 48  # bytes a row (an object took ~200)


def _columns(rows: RequestRecords) -> list[array[int] | array[float]]:
    return [rows.order, rows.arrival_s, rows.first_s, rows.finish_s, rows.prompt, rows.output,
            rows.cached, rows.preemptions, rows.rejected]  # fmt: skip


def test_a_report_compares_copies_and_pickles_with_its_records() -> None:
    w = make_workload("mixed", seed=5, num_requests=80, rate=20.0)
    a = simulate(w, SimConfig())
    b = simulate(make_workload("mixed", seed=5, num_requests=80, rate=20.0), SimConfig())
    assert isinstance(a.records, RequestRecords)
    assert a == b  # separately generated, equal workloads: equal records
    assert hash(a.records) == hash(b.records)
    assert pickle.loads(pickle.dumps(a.records)) == a.records
    assert copy.deepcopy(a.records) is a.records  # read-only: asdict need not copy the workload
    d = a.to_dict()["records"]
    assert len(d) == len(w)
    assert d[0] == {f: getattr(a.records[0], f) for f in RequestRecord.__dataclass_fields__}
    c = simulate(make_workload("mixed", seed=5, num_requests=80, rate=21.0), SimConfig())
    assert c.records != a.records


def test_rejected_requests_keep_a_row_with_no_times() -> None:
    long = SimRequest("long", 0.5, tuple(range(10, 400)), 3)
    ok = SimRequest("ok", 0.0, (5, 6, 7), 2)
    cfg = SimConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8, max_model_len=256),
        cache=CacheConfig(block_size=16, num_blocks=64, model_id="t"),
    )
    r = simulate(Workload("w", (ok, long)), cfg)
    recs = {x.request_id: x for x in r.records}
    assert recs["long"] == RequestRecord("long", "", "", 0.5, None, None, 390, 0, 0, 0, True)
    assert recs["ok"].num_output_tokens == 2
    assert recs["ok"].finish_s is not None


@pytest.mark.parametrize("seed", range(5))
def test_token_usage_rebuilt_from_empty_slots_is_the_per_step_formula_bit_for_bit(
    seed: int,
) -> None:
    rng = np.random.default_rng(seed)
    rec = Recorder()
    rec.capacity_tokens = cap = int(rng.integers(1, 100_000))
    want = []
    for step in range(200):
        usage = float(rng.choice([0.0, rng.random(), 1.0]))
        empty = int(rng.integers(0, cap + 1))
        rec.on_step(float(step), 0.01, usage, None, empty, (1, 0, 1))
        want.append(max(0.0, usage - empty / cap))
    assert rec.token_usage().tolist() == want
    assert rec.allocated_usage() is rec.usage  # paged: nothing stored for allocated usage


def test_outputs_are_the_seeded_draws_as_an_8_byte_array() -> None:
    sim = SimRequest("r7", 0.0, (1, 2), 50)
    out = output_tokens(sim, seed=3, stops=True)
    rng = np.random.default_rng(stable_seed(3, "output", "r7"))
    want = rng.integers(VOCAB_LOW, VOCAB_HIGH, size=50).tolist()
    want[-1] = EOS_TOKEN_ID
    assert out.typecode == "q"
    assert out.tolist() == want
    assert all(type(t) is int for t in out)  # Python ints (the scheduler hashes them)
    given = SimRequest("g", 0.0, (1,), 3, output_token_ids=(9, 8, 7))
    assert output_tokens(given, seed=0, stops=False).tolist() == [9, 8, 7]
