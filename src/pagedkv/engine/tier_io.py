"""Moving KV blocks between the paged KV tensors and the KV tiers (host RAM, disk, Redis).

Stores: after a step, every full block the step finished computing is copied out
(``PagedKVCache.read_block``), wrapped in a checksummed payload naming the model, layout and block
hash, and handed to the offload coordinator, whose writer thread fills the tiers (it never
blocks the step; a full queue drops the write). Loads: when the scheduler admits a request whose
prefix continues in a tier (``SchedulerOutput.block_loads``), the payloads are fetched, checked
and written into the blocks the scheduler allocated; a request any of whose blocks is missing or
corrupt, or whose load raises, is reported in ``failed_loads`` and recomputes instead (the
scheduler rolls its loaded-but-unfilled blocks back; they are never committed). Never wrong
data: a payload is written only after its header, hash and checksum check out.

Slower than recompute? The engine reports each step's model time (:meth:`TierIO.observe_step`);
steps that prefill at least a block's worth of tokens feed a moving average of seconds per
token, and ``block_size`` times that is handed to the coordinator as the recompute cost of a
block (``OffloadCoordinator.set_recompute_cost``), which then skips tiers whose measured load
time per block is higher.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from pagedkv.engine.kv_cache import PagedKVCache
from pagedkv.errors import CorruptBlockError, InvalidRequestError
from pagedkv.sched import Scheduler, SchedulerOutput
from pagedkv.sched.output import ScheduledRequest
from pagedkv.tiers.base import TierStats
from pagedkv.tiers.config import TierConfig, build_offload
from pagedkv.tiers.offload import OffloadCoordinator
from pagedkv.tiers.payload import PayloadHeader, TierLayout, decode, encode

logger = logging.getLogger(__name__)


RECOMPUTE_EWMA_WEIGHT = 0.2
"""Weight of the newest prefill step in the moving average of seconds per token."""


class TierIO:
    """The engine's side of the KV tiers: store finished blocks, load admitted prefixes."""

    def __init__(self, offload: OffloadCoordinator, layout: TierLayout) -> None:
        self.offload = offload
        self.layout = layout
        self.num_stored = 0
        self.num_loaded = 0
        self.num_failed_loads = 0
        self.prefill_s_per_token: float | None = None  # moving average; None until measured
        self.measure_recompute = True  # False: never skip a tier as slower than recompute

    @classmethod
    def try_build(
        cls,
        config: TierConfig | None,
        layout: TierLayout,
        offload: OffloadCoordinator | None = None,
    ) -> TierIO | None:
        """The engine's tier I/O over ``offload``, or over the stack ``config`` describes;
        None when neither asks for a tier."""
        if offload is None and config is not None:
            offload = build_offload(config, layout)
        return None if offload is None else cls(offload, layout)

    def close(self, flush_timeout_s: float | None = 10.0) -> None:
        """Write what is queued (up to the timeout) and close every tier."""
        self.offload.close(flush_timeout_s)

    def tier_stats(self) -> tuple[TierStats, ...]:
        """A snapshot of every tier's counters, top tier first."""
        return self.offload.stats().tiers

    # ------------------------------------------------------------------ cost model
    def observe_step(self, seqs: Sequence[ScheduledRequest], seconds: float) -> None:
        """Feed one step's model time into the recompute estimate. Only steps that prefill at
        least one block's worth of tokens count (decode-only steps are dominated by fixed
        per-step costs and would overstate what recomputing a prefix costs)."""
        if not self.measure_recompute:
            return
        num_prefill = sum(sr.num_tokens for sr in seqs if sr.is_prefill)
        if num_prefill < self.layout.block_size or seconds <= 0:
            return
        per = seconds / sum(sr.num_tokens for sr in seqs)
        old = self.prefill_s_per_token
        w = RECOMPUTE_EWMA_WEIGHT
        self.prefill_s_per_token = per if old is None else (1 - w) * old + w * per
        self.offload.set_recompute_cost(self.prefill_s_per_token * self.layout.block_size)

    # ------------------------------------------------------------------ stores
    def blocks_to_store(
        self, sched: Scheduler, seqs: Sequence[ScheduledRequest], accepted: dict[str, int]
    ) -> list[tuple[int, bytes]]:
        """``(block_id, hash)`` of each block this step fills with computed KV. Call before
        ``update`` (a finishing request's table and hashes are gone after it); ``accepted``
        maps a speculative request to its number of accepted drafts."""
        bs = self.layout.block_size
        out: list[tuple[int, bytes]] = []
        for sr in seqs:
            rid = sr.request_id
            if rid not in sched.manager:
                continue
            rejected = sr.num_draft_tokens - accepted.get(rid, sr.num_draft_tokens)
            end = sr.start_position + sr.num_tokens - rejected  # computed after this step
            hashes = sched.manager.block_hashes(rid)
            num_accepted = sr.num_draft_tokens - rejected
            if num_accepted:  # blocks filled by accepted drafts: hashed once they are appended
                drafts = sr.token_ids[1 : 1 + num_accepted]
                hashes = hashes + sched.manager.preview_block_hashes(rid, drafts)
            first = sr.start_position // bs
            last = min(end // bs, len(hashes), len(sr.block_table))
            out.extend((int(sr.block_table[i]), hashes[i]) for i in range(first, last))
        return out

    def store(self, kv: PagedKVCache, blocks: Sequence[tuple[int, bytes]]) -> None:
        """Queue the payloads of ``blocks`` (still holding their KV: call right after update)."""
        bs = self.layout.block_size
        bodies = read_blocks(kv, [b for b, _ in blocks])
        for (_, block_hash), body in zip(blocks, bodies, strict=True):
            payload = encode(PayloadHeader(self.layout, block_hash, bs), body)
            if self.offload.submit(block_hash, payload):
                self.num_stored += 1

    # ------------------------------------------------------------------ loads
    def load(self, sched: Scheduler, out: SchedulerOutput, kv: PagedKVCache) -> set[str]:
        """Fill the blocks of ``out.block_loads``; return the loading requests that failed."""
        if not out.block_loads:
            return set()
        owner: dict[int, str] = {}
        for rid in out.loading_ids:
            for b in sched.manager.block_ids_view(rid):
                owner[b] = rid
        per_request: dict[str, list[tuple[int, bytes]]] = {}
        for block_id, block_hash in out.block_loads:
            per_request.setdefault(owner[block_id], []).append((block_id, block_hash))
        failed: set[str] = set()
        for rid, items in per_request.items():
            hashes = [h for _, h in items]
            try:  # any failure (a corrupt payload, a tier that raises) fails this request only
                payloads = self.offload.load(hashes)
                if len(payloads) < len(items):
                    raise CorruptBlockError(f"{len(payloads)} of {len(items)} blocks came back")
                for (block_id, block_hash), data in zip(items, payloads, strict=False):
                    body = decode(data, self.layout, block_hash).body
                    kv.write_block(block_id, bytes(body))
            except Exception as exc:
                logger.warning("loading the prefix of %s failed (%s); recomputing it", rid, exc)
                failed.add(rid)
                self.num_failed_loads += 1
                continue
            self.num_loaded += len(items)
        return failed


def read_blocks(kv: PagedKVCache, block_ids: Sequence[int]) -> list[bytes]:
    """``[kv.read_block(b) for b in block_ids]`` (the same bytes) with one gather per layer
    buffer and one device-to-host copy for the whole step, not one per block: per block that
    costs ~8 small tensor ops (and, on a GPU, a synchronizing copy each)."""
    if len(block_ids) <= 1:
        return [kv.read_block(b) for b in block_ids]
    for b in block_ids:
        if not 0 <= b < kv.num_blocks:
            raise InvalidRequestError(f"block id {b} is out of range (0..{kv.num_blocks - 1})")
    idx = torch.tensor(list(block_ids), dtype=torch.long, device=kv.device)
    # [n, 2 x layers, block_size, kv heads, head dim]: each block's K of every layer, then V
    # (buffers are [kv heads, blocks, block_size, head dim]; the bytes are token-major)
    flat = torch.stack(
        [buf.index_select(1, idx).permute(1, 2, 0, 3) for buf in (*kv.k, *kv.v)], dim=1
    )
    flat = flat.contiguous().cpu()
    if flat.dtype is torch.bfloat16:
        flat = flat.view(torch.int16)
    arr = flat.numpy()
    return [arr[i].tobytes() for i in range(len(block_ids))]
