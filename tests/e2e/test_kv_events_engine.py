"""An engine's KV events on the wire: ``LLM(kv_events=...)`` publishes what its pool and its
tiers store and drop, with the engine's own block hashes, to a real ZeroMQ subscriber."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pagedkv.core.hashing import HashContext, hash_blocks
from pagedkv.engine.llm import LLM
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.kvevents.subscriber import EventSubscriber
from pagedkv.kvevents.wire import WireBlockRemoved, WireBlockStored

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _collect(sub: EventSubscriber, until: float) -> list[WireBlockStored | WireBlockRemoved]:
    out: list[WireBlockStored | WireBlockRemoved] = []
    while time.monotonic() < until:
        for _, batch in sub.poll(50):
            out.extend(e for e in batch.events if isinstance(e, WireBlockStored | WireBlockRemoved))
    return out


def test_engine_publishes_pool_and_tier_events_with_its_own_hashes(model_dir: Path) -> None:
    llm = LLM(
        str(model_dir),
        block_size=BLOCK_SIZE,
        num_blocks=12,  # small: the second prompt evicts the first one's blocks
        kv_events="tcp://127.0.0.1:*",
        host_tier_bytes=64 << 20,
    )
    pub = llm.engine.kv_publisher
    assert pub is not None
    assert pub.replay_endpoint is not None
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        first = [(7 * i) % 200 + 3 for i in range(5 * BLOCK_SIZE + 3)]
        second = [(11 * i) % 200 + 5 for i in range(9 * BLOCK_SIZE)]
        llm.generate([first], sp, progress=False)
        tio = llm.engine.tier_io
        assert tio is not None
        assert tio.offload.flush(10.0)
        llm.generate([second], sp, progress=False)
        events = _collect(sub, time.monotonic() + 1.0)
    finally:
        sub.close()
        llm.close()
    model_id = llm.engine.config.model_id
    ctx = HashContext(model_id=model_id)
    want_first = hash_blocks(first, BLOCK_SIZE, ctx)
    gpu_stored = [h for e in events if isinstance(e, WireBlockStored) and e.medium == "GPU"
                  for h in e.block_hashes]  # fmt: skip
    assert gpu_stored[: len(want_first)] == want_first  # the engine's hashes, in chain order
    first_event = next(e for e in events if isinstance(e, WireBlockStored))
    assert first_event.parent_block_hash is None
    assert first_event.token_ids == first[: len(first_event.block_hashes) * BLOCK_SIZE]
    removed = {h for e in events if isinstance(e, WireBlockRemoved) and e.medium == "GPU"
               for h in e.block_hashes}  # fmt: skip
    assert removed & set(want_first)  # the small pool evicted some of the first prompt
    cpu_stored = {h for e in events if isinstance(e, WireBlockStored) and e.medium == "cpu"
                  for h in e.block_hashes}  # fmt: skip
    assert set(want_first) <= cpu_stored  # the host tier reported each block it took
    assert sub.num_missed == 0
