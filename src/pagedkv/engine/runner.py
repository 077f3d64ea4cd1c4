"""The model runner: executes one scheduler step on the paged KV cache and returns logits.

Per step: apply copy-on-write block copies first, grow the KV tensors if the (elastic) pool handed
out a block past their end, lay the scheduled tokens out back to back, run the model once and
project to the vocabulary only the rows that sample: the last token of a sampling sequence, or,
for a speculative decode, the last token and every draft (row i predicts the token after input i).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from pagedkv.engine import native
from pagedkv.engine.attention import build_metadata
from pagedkv.engine.kv_cache import PagedKVCache
from pagedkv.engine.models.llama import LlamaModel
from pagedkv.errors import InvalidRequestError
from pagedkv.sched.output import ScheduledRequest

logger = logging.getLogger(__name__)
_LAST = 1 << 62  # sort key after every position


class StepBatch(Protocol):
    """What the runner reads of a step (``SchedulerOutput`` satisfies it)."""

    @property
    def scheduled(self) -> list[ScheduledRequest]: ...
    @property
    def block_copies(self) -> list[tuple[int, int]]: ...


class ModelRunner:
    """Runs a model over paged KV. Stateless between steps apart from the KV tensors."""

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: PagedKVCache,
        *,
        batched_decode: bool = True,
        max_num_blocks: int | None = None,
        decode_kernel: str = "auto",
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.batched_decode = batched_decode
        self.device = model.device
        self.max_num_blocks = max_num_blocks  # the pool's capacity: tensors never grow past it
        self.decode_kernel = decode_kernel
        self._native_ok = self._check_native(decode_kernel)
        # sequences that want every prefill position's logits (prompt logprobs)
        self.prompt_logits_ids: set[str] = set()

    def _check_native(self, decode_kernel: str) -> bool:
        """Whether the native decode kernel may run (building it when it may be wanted)."""
        if decode_kernel == "torch":
            return False
        cfg, spec = self.model.config, self.kv_cache.spec
        fits = self.device.type == "cpu" and self.model.compute_dtype is torch.float32
        fits = fits and native.supports(
            cfg.num_attention_heads, cfg.num_key_value_heads, spec.block_size, spec.head_dim,
            spec.dtype,
        )  # fmt: skip
        if decode_kernel == "native":
            if not fits:
                raise InvalidRequestError(
                    "decode_kernel='native' needs a CPU float32 model (block size <= "
                    f"{native.MAX_BLOCK_SIZE}, head_dim <= {native.MAX_HEAD_DIM}); this one is "
                    f"{spec.dtype} on {self.device}"
                )
            if not native.available():
                raise InvalidRequestError(
                    f"decode_kernel='native': the kernel could not be built "
                    f"({native.unavailable_reason()})"
                )
            return True
        return fits and native.available()

    def uses_native_decode(self) -> bool:
        """Whether decodes run the native kernel: ``native``, or ``auto`` on a CPU float32
        model once the kernel is built (it shares rows among torch's intra-op threads)."""
        return self._native_ok

    def ensure_blocks(self, num_blocks: int) -> None:
        """Grow the KV tensors to hold block ids below ``num_blocks`` (elastic pools).

        Growth is geometric (at least double, capped at ``max_num_blocks``): each growth copies
        the whole cache, so doubling keeps the total copy cost linear in the final size even
        when the pool itself grows in small fixed steps.
        """
        current = self.kv_cache.num_blocks
        if num_blocks <= current:
            return
        target = max(num_blocks, 2 * current)
        if self.max_num_blocks is not None:
            target = max(num_blocks, min(target, self.max_num_blocks))
        logger.info("growing KV tensors from %d to %d blocks", current, target)
        self.kv_cache.grow(target)

    def execute(self, batch: StepBatch) -> dict[str, torch.Tensor]:
        """Run one step; returns ``request_id -> float32 logits [rows, vocab]`` for every
        sequence that samples (1 row, or 1 + num_draft_tokens rows for a speculative decode).
        A prefill of a sequence in ``prompt_logits_ids`` gets a row for every position it
        computes (the last one the sampling row, when it samples). The values are adjacent
        row ranges of one tensor, in ``batch.scheduled``'s order (the sampler then reads them
        as one tensor without a copy: :mod:`.row_views`)."""
        # Phase 1: single-token decodes first, shortest context first (a stable sort, so the
        # rest keep the scheduler's order): attention's length groups are then contiguous
        # row ranges.
        seqs: Sequence[ScheduledRequest] = sorted(
            batch.scheduled, key=lambda s: s.start_position if s.num_tokens == 1 else _LAST
        )
        tables = [s.block_table for s in seqs if len(s.block_table)]
        top = int(np.concatenate(tables).max()) if tables else -1
        for src, dst in batch.block_copies:
            top = max(top, src, dst)
        self.ensure_blocks(top + 1)
        self.kv_cache.copy_blocks(batch.block_copies)
        if not seqs:
            return {}
        # Phase 2: the tokens back to back, checked, and the rows that get logits.
        ids, rows, owners = self._layout(seqs, batch.scheduled)
        spec = self.kv_cache.spec
        meta = build_metadata(
            seqs,
            spec.block_size,
            self.device,
            batched_decode=self.batched_decode,
            cache_row_elems=spec.block_size * spec.num_kv_heads * spec.head_dim,
            native_decode=self.uses_native_decode(),
            sliding_window=self.model.config.sliding_window,
            full_attention=not self.model.config.all_layers_windowed,
        )
        # Phase 3: the model, then the vocabulary projection of those rows only.
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        hidden = self.model.forward(input_ids, meta, self.kv_cache)
        if not rows:
            return {}
        # rows 0..k-1 (most decode steps): a view, no gather. It starts where the buffer
        # does, so the projection reads memory aligned as a gathered copy would be.
        if rows == list(range(len(rows))):
            picked = hidden[: len(rows)]
        else:
            picked = hidden[torch.tensor(rows, device=self.device)]
        logits = self.model.logits(picked)
        result: dict[str, torch.Tensor] = {}
        start = 0
        for rid, count in owners:
            result[rid] = logits[start : start + count]
            start += count
        return result

    def _layout(
        self, seqs: Sequence[ScheduledRequest], scheduled: Sequence[ScheduledRequest]
    ) -> tuple[list[int], list[int], list[tuple[str, int]]]:
        """The token ids of ``seqs`` back to back (checked against the vocabulary), the rows
        of them that get logits and ``(request id, row count)`` per owner, both in
        ``scheduled``'s order."""
        vocab = self.model.config.vocab_size
        ids: list[int] = []
        ranges: dict[str, range] = {}
        for s in seqs:
            if len(s.token_ids) != s.num_tokens:
                raise InvalidRequestError(
                    f"request {s.request_id!r}: {len(s.token_ids)} token ids for "
                    f"{s.num_tokens} positions"
                )
            ids.extend(s.token_ids)
            end = len(ids)
            if s.is_prefill and s.request_id in self.prompt_logits_ids:
                ranges[s.request_id] = range(end - s.num_tokens, end)
            elif s.samples:
                ranges[s.request_id] = range(end - 1 - s.num_draft_tokens, end)
        if ids and not 0 <= min(ids) <= max(ids) < vocab:  # one check; name the culprit
            for s in seqs:
                bad = [t for t in s.token_ids if not 0 <= t < vocab]
                if bad:
                    raise InvalidRequestError(
                        f"request {s.request_id!r} has token ids outside [0, {vocab}): {bad[:5]}"
                    )
        rows: list[int] = []
        owners: list[tuple[str, int]] = []
        for s in scheduled:
            r = ranges.get(s.request_id)
            if r is not None:
                rows.extend(r)
                owners.append((s.request_id, len(r)))
        return ids, rows, owners
