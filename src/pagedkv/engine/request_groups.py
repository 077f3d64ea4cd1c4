"""The engine's live requests: each request's group of samples and each sample's sequence.

A request is a :class:`RequestGroup` under its request id; each of its ``n`` samples is a
:class:`SampleState` under its own sequence id, which is also its scheduler request's id
(the request id itself when ``n == 1``, ``"<request_id>#<index>"`` otherwise).

``n > 1`` samples share the prompt's KV through a copy-on-write fork. The first sample is
scheduled with the prompt minus its last token, and the engine "samples" that last token for it
(``force_token``), so after its prefill every sample has the same tokens and the same KV, with
the last prompt position still to compute. The other samples are forked there
(:meth:`RequestGroups.fork_samples`: full blocks shared by reference, the partial last block
copied on first write) and each computes the last prompt position itself, so each draws its
own first token from its own generator.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence

import torch

from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.sampler import SamplingParams, make_generator
from pagedkv.engine.samples import RequestGroup, SampleState
from pagedkv.engine.structured_output import StructuredOutputManager
from pagedkv.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pagedkv.errors import InvariantViolation, OverloadedError, UnknownRequestError
from pagedkv.sched import FinishReason, Request, RequestStatus, ScheduledRequest, Scheduler


class RequestGroups:
    """Live request groups by request id and their samples by sequence id; creates, forks,
    fails and retires samples, keeping the scheduler's requests in step.

    Invariants (``check_invariants()`` verifies each):
      E1  every live sample's ``seq_id`` maps back to its live group
    Complexity: lookups O(1); adding, failing, aborting or retiring a group O(n).
    """

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunner,
        device: torch.device,
        tokenizer: Tokenizer | None,
        structured_outputs: Callable[[], StructuredOutputManager],
        seed: int | None,
    ) -> None:
        self._scheduler = scheduler
        self._runner = runner  # its prompt_logits_ids: the sequences asking for prompt logprobs
        self._device = device
        self._tokenizer = tokenizer
        self._structured_outputs = structured_outputs
        self._seeds = None if seed is None else random.Random(seed)  # EngineConfig.seed
        self._groups: dict[str, RequestGroup] = {}
        self._samples: dict[str, tuple[RequestGroup, SampleState]] = {}  # seq_id -> owner

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def owner(self, seq_id: str) -> tuple[RequestGroup, SampleState]:
        """The group and sample of a live sequence (``KeyError`` if it is not live)."""
        return self._samples[seq_id]

    def get(self, seq_id: str) -> tuple[RequestGroup, SampleState] | None:
        return self._samples.get(seq_id)

    # ------------------------------------------------------------------ lifecycle
    def add(
        self,
        request_id: str,
        params: SamplingParams,
        ids: list[int],
        stops: tuple[int, ...],
        grammar: str | None,
        cache_salt: str | None = None,
        prompt: str | None = None,
    ) -> None:
        """Register a checked request and queue its samples; a scheduler refusal (raised
        before anything is registered) leaves everything unchanged. Every sequence of the
        request hashes its blocks under ``cache_salt``."""
        group = RequestGroup(request_id, params, ids, stops, time.perf_counter())
        group.grammar = grammar
        group.cache_salt = cache_salt
        group.prompt = prompt
        fork = params.n > 1 and len(ids) > 1 and ids[-1] not in stops
        if fork:  # see the module docstring: the last prompt token is "sampled" for sample 0
            sample0 = self.new_sample(group, 0, force_token=ids[-1])
            req = self._make_request(sample0.seq_id, ids[:-1], params.max_tokens + 1, group)
        else:
            sample0 = self.new_sample(group, 0)
            req = self._make_request(sample0.seq_id, ids, params.max_tokens, group)
        self._scheduler.add_request(req)  # may raise PromptTooLongError: nothing registered yet
        self._register(group, sample0)
        self._groups[request_id] = group
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # the first token has no context
            self._runner.prompt_logits_ids.add(sample0.seq_id)
        if not fork:
            for i in range(1, params.n):
                self._add_independent(group, i)

    def new_sample(
        self, group: RequestGroup, index: int, force_token: int | None = None
    ) -> SampleState:
        """Sample ``index`` of ``group`` (not registered): its generator (the request's seed
        plus ``index``, else one drawn from ``EngineConfig.seed``), detokenizer and grammar."""
        seq_id = group.request_id if group.params.n == 1 else f"{group.request_id}#{index}"
        seed = group.params.seed
        if seed is None and self._seeds is not None:  # EngineConfig.seed: reproducible runs
            seed = self._seeds.getrandbits(62)
        gen = make_generator(None if seed is None else seed + index, self._device)
        detok = None
        if self._tokenizer is not None:
            skip = group.params.skip_special_tokens
            detok = IncrementalDetokenizer(
                self._tokenizer, group.prompt_token_ids, skip_special_tokens=skip
            )
        smp = SampleState(seq_id, index, gen, detok, force_token)
        if group.grammar is not None:
            smp.grammar = self._structured_outputs().matcher(group.grammar)
        if group.params.logprobs is not None:
            smp.logprobs = []
        return smp

    def _register(self, group: RequestGroup, smp: SampleState) -> None:
        group.samples.append(smp)
        self._samples[smp.seq_id] = (group, smp)

    def _make_request(
        self, seq_id: str, ids: list[int], max_tokens: int, group: RequestGroup
    ) -> Request:
        # prompt logprobs need every prompt position computed: a salt of its own means no
        # prefix-cache hit can skip one (vLLM skips cache reads for such requests alike)
        salt = group.cache_salt
        if group.params.prompt_logprobs is not None:
            salt = f"prompt-logprobs/{seq_id}"
        return Request(
            seq_id,
            ids,
            max_tokens=max_tokens,
            stop_token_ids=group.stop_token_ids,
            arrival_time=group.arrival_s,
            cache_salt=salt,
        )

    def _add_independent(self, group: RequestGroup, index: int) -> None:
        smp = self.new_sample(group, index)
        req = self._make_request(smp.seq_id, group.prompt_token_ids, group.params.max_tokens, group)
        self._scheduler.add_request(req)
        self._register(group, smp)

    def fork_samples(self, group: RequestGroup, parent: SampleState) -> None:
        """Fork samples 1..n-1 from sample 0 right after its prefill (copy-on-write)."""
        sched = self._scheduler
        for i in range(1, group.params.n):
            smp = self.new_sample(group, i)
            try:
                sched.fork(parent.seq_id, smp.seq_id)
            except OverloadedError:  # max_num_seqs reached: queue it as its own request instead
                self._add_independent(group, i)
                continue
            self._register(group, smp)

    def fail_samples(self, failures: Mapping[str, Exception]) -> dict[str, RequestGroup]:
        """Finish each failed sample (and the rest of its group) with ``"error"``; returns the
        groups to report. Call before ``update`` so that it skips them."""
        changed: dict[str, RequestGroup] = {}
        for sid in failures:
            group, smp = self._samples[sid]
            req = self._scheduler.requests.get(sid)
            if req is not None and req.status is RequestStatus.RUNNING:
                self._scheduler.finish(sid, FinishReason.ERROR)
            smp.finish_reason = FinishReason.ERROR
            for other in group.samples:  # a group cannot complete without its failed sample
                if other.finish_reason is None:
                    if other.seq_id in self._scheduler.requests:
                        self._scheduler.abort(other.seq_id)
                    other.finish_reason = FinishReason.ERROR
            while len(group.samples) < group.params.n:
                missing = self.new_sample(group, len(group.samples))
                missing.finish_reason = FinishReason.ERROR
                self._register(group, missing)
            changed[group.request_id] = group
        return changed

    def abort(self, request_id: str) -> None:
        """Abort a request (all its samples) in any state."""
        group = self._groups.pop(request_id, None)
        if group is None:
            raise UnknownRequestError(f"unknown request {request_id!r}")
        for s in group.samples:
            self._samples.pop(s.seq_id, None)
            self._runner.prompt_logits_ids.discard(s.seq_id)
            if s.finish_reason is None and s.seq_id in self._scheduler.requests:
                self._scheduler.abort(s.seq_id)

    def retire(self, group: RequestGroup) -> None:
        """Forget a finished group (its final output has been built)."""
        del self._groups[group.request_id]
        for s in group.samples:
            self._samples.pop(s.seq_id, None)
            self._runner.prompt_logits_ids.discard(s.seq_id)

    def mark_scheduled(self, scheduled: Sequence[ScheduledRequest], now: float) -> None:
        """Record when each request's first sequence was first scheduled (its queue time)."""
        for sr in scheduled:
            entry = self._samples.get(sr.request_id)
            if entry is not None and entry[0].first_scheduled_s is None:
                entry[0].first_scheduled_s = now

    def check_invariants(self) -> None:
        for sid, (group, smp) in self._samples.items():
            if smp.seq_id != sid or self._groups.get(group.request_id) is not group:
                raise InvariantViolation(f"E1: sample {sid} is not owned by a live group")
