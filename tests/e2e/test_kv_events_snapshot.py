"""A consumer that joins late: the engine's snapshot (cached hashes as of batch S) plus the
stream from S + 1 gives exactly the pool's cached set, even when the replay buffer is far too
short to replay the history (a few batches), with nothing missed or applied twice."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pagedkv.engine.llm import LLM
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.tiny import write_tiny_model
from pagedkv.kvevents.config import KVEventsConfig
from pagedkv.kvevents.subscriber import EventSubscriber
from pagedkv.kvevents.wire import WireAllBlocksCleared, WireBlockStored
from pagedkv.route.index import PrefixIndex

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _prompt(seed: int, blocks: int) -> list[int]:
    return [(seed * 31 + i * 7) % 200 + 3 for i in range(blocks * BLOCK_SIZE + 5)]


def _cached(llm: LLM) -> set[bytes]:
    pool = llm.engine.scheduler.manager.pool
    hashes = (pool.block_hash(i) for i in range(pool.num_materialized_blocks))
    return {h for h in hashes if h is not None}


def test_snapshot_then_stream_equals_the_pool(model_dir: Path) -> None:
    config = KVEventsConfig("tcp://127.0.0.1:*", buffer_steps=2)
    llm = LLM(str(model_dir), block_size=BLOCK_SIZE, num_blocks=20, kv_events=config)
    pub = llm.engine.kv_publisher
    assert pub is not None
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    sub = EventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        for seed in range(6):  # many batches before the consumer joins: replay cannot cover them
            llm.generate([_prompt(seed, 4)], sp, progress=False)
        seq, hashes = llm.engine.kv_events_snapshot()
        assert seq >= 2 * config.buffer_steps
        assert set(hashes) == _cached(llm)
        assert len(hashes) >= 4
        index: PrefixIndex[str] = PrefixIndex()
        index.store("e", hashes, "GPU")
        sub.start_after(seq)
        seen: list[int] = []
        for seed in range(6, 9):  # the small pool evicts snapshot blocks: removals must land
            llm.generate([_prompt(seed, 4)], sp, progress=False)
            _drain(sub, pub.last_seq, index, seen)
        assert seen == list(range(seq + 1, pub.last_seq + 1))  # each batch after S, once
        assert sub.num_missed == 0
        want = _cached(llm)
        assert not want <= set(hashes)  # the pool changed since the snapshot
        assert all(index.match([h]) == {"e": 1} for h in want)  # every cached block indexed,
        assert index.num_blocks("e") == len(want)  # and nothing else (no stale entry)
    finally:
        sub.close()
        llm.close()


def _drain(sub: EventSubscriber, last: int, index: PrefixIndex[str], seen: list[int]) -> None:
    """Apply batches up to seq ``last`` (within 3 s) to ``index``; their seqs go to ``seen``."""
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and (not seen or seen[-1] < last):
        for s, batch in sub.poll(50):
            seen.append(s)
            for event in batch.events:
                hashes = [h for h in getattr(event, "block_hashes", ()) if isinstance(h, bytes)]
                if isinstance(event, WireBlockStored):
                    index.store("e", hashes, event.medium)
                elif isinstance(event, WireAllBlocksCleared):
                    index.clear("e", "GPU")
                else:
                    index.remove("e", hashes, event.medium)
