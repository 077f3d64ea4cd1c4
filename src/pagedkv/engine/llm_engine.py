"""LLMEngine: requests in, tokens out, one scheduler step at a time.

A step::

    propose drafts (prompt lookup) for decoding requests      -> Request.draft_token_ids
    SchedulerOutput = scheduler.schedule()
    load tier blocks (block_loads) into their device blocks    (a failed load: recompute)
    logits = runner.execute(output)                            paged KV written, attention run
    sample each sampling request; verify drafts                accepted tokens (+ bonus)
      (a run that raises is bisected, and sampling is checked per request, so one request
       fails only itself: ``pagedkv.engine.step_faults``)
    scheduler.update(output, accepted, failed_loads)           commit / roll back / finish
    offload the full blocks this step computed                 (with an offload coordinator)
    detokenize, stop strings (scheduler.finish), fork n > 1 samples

The engine owns the step; its parts live in modules of their own:

    engine_wiring     the checkpoint loaded and each component's section of the config
    request_intake    a prompt and its parameters checked before anything is registered
    request_groups    the live requests and their samples; ``n > 1`` forks (copy-on-write)
    step_sampling     drafts, prompt logprobs and the step's batch draw
    sample_output     detokenization, stop strings, streaming deltas, ``GenerationOutput``
    kv_event_relay    the pool's and tiers' KV events, one batch per step
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pagedkv.engine import engine_wiring
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.generation_config import GenerationDefaults
from pagedkv.engine.gguf_q8act import deferred_activations, set_gguf_activations
from pagedkv.engine.host_alloc import tune_host_allocator
from pagedkv.engine.kv_cache import PagedKVCache
from pagedkv.engine.kv_event_relay import kv_events_snapshot, publish_kv_events, start_kv_events
from pagedkv.engine.models.llama import LlamaModel
from pagedkv.engine.outputs import GenerationOutput
from pagedkv.engine.request_groups import RequestGroups
from pagedkv.engine.request_intake import (
    check_cache_salt,
    check_features,
    prompt_token_ids,
    stop_token_ids,
)
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.sample_output import (
    append_tokens,
    build_output,
    release_text,
    stop_prefix_len,
)
from pagedkv.engine.sampler import SamplingParams
from pagedkv.engine.samples import RequestGroup
from pagedkv.engine.spec_decode import DraftProposer, NgramProposer
from pagedkv.engine.step_faults import execute_isolating, nonfinite_requests
from pagedkv.engine.step_sampling import propose_drafts, sample_step, take_prompt_logprobs
from pagedkv.engine.structured_output import StructuredOutputManager
from pagedkv.engine.tier_io import TierIO
from pagedkv.engine.tokenizer import Tokenizer
from pagedkv.errors import InvalidRequestError, InvariantViolation
from pagedkv.sched import FinishReason, RequestOutput, Scheduler, SchedulerOutput
from pagedkv.tiers.offload import OffloadCoordinator

if TYPE_CHECKING:
    from pagedkv.kvevents.publisher import ZmqEventPublisher

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching generation over paged KV.

    Invariants (``check_invariants()`` verifies each):
      E1  every live sample's ``seq_id`` maps back to its group (``RequestGroups``)
      E2  the scheduler's invariants hold; the KV tensors cover every block holding computed KV
    """

    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Tokenizer | None,
        config: EngineConfig,
        *,
        offload: OffloadCoordinator | None = None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        if config.tune_host_allocator and model.device.type == "cpu":
            tune_host_allocator()
        mcfg = model.config
        if config.dtype == "auto":  # built from a model directly: compute in the model's dtype
            config = replace(config, dtype=str(model.dtype).removeprefix("torch."))
        max_len = engine_wiring.check_max_model_len(config, mcfg)
        if config.quantization is not None and model.quantization != config.quantization:
            with deferred_activations(model, config.gguf_activations):  # the GGUF layers' mode
                model.quantize(config.quantization)  # here, so every loader's model gets it
        elif config.gguf_activations != "float32":
            set_gguf_activations(model, config.gguf_activations)  # refuses: already quantized
        if config.linear_kernel != model.linear_kernel:
            model.set_linear_kernel(config.linear_kernel)
        if config.matmul_precision != model.matmul_precision:
            model.set_matmul_precision(config.matmul_precision)  # what runs: the model's
        # what decides the KV content besides the checkpoint joins its id (cache_namespace)
        namespace = engine_wiring.cache_namespace(config.model_id, model, config.gguf_activations)
        config = replace(config, model_id=namespace)
        self.config = config
        sections = engine_wiring.build_sections(config, mcfg, max_len)
        self.tier_io = TierIO.try_build(config.tiers, sections.layout, offload)  # see close()
        tier_index = None if self.tier_io is None else self.tier_io.offload
        self.scheduler = Scheduler(sections.scheduler, sections.cache, tier_index=tier_index)
        self.max_model_len = max_len
        self.kv_publisher: ZmqEventPublisher | None = start_kv_events(config, self.tier_io)
        pool = self.scheduler.manager.pool
        kv = PagedKVCache(sections.spec, pool.num_materialized_blocks, model.device)
        self.runner = ModelRunner(
            model,
            kv,
            batched_decode=config.batched_decode,
            max_num_blocks=sections.num_blocks,
            decode_kernel=config.decode_kernel,
        )
        self.proposer: DraftProposer | None = (
            NgramProposer(config.num_speculative_tokens) if config.num_speculative_tokens else None
        )
        self.eos_token_ids = engine_wiring.eos_token_ids(mcfg, tokenizer)
        self.generation_defaults = GenerationDefaults()  # from_model_dir reads the checkpoint's
        self._structured: StructuredOutputManager | None = None  # built on first use
        self._requests = RequestGroups(
            self.scheduler,
            self.runner,
            model.device,
            tokenizer,
            self.structured_outputs,
            config.seed,
        )
        self.num_draft_tokens = 0
        self.num_accepted_draft_tokens = 0
        if config.freeze_gc_heap:
            # What exists now (the model, modules imported by torch and transformers: ~400k
            # objects in the benchmark process, a 190 ms full collection) lives as long as the
            # engine: move it out of the cyclic collector's generations so collections during
            # serving only scan what serving allocates. vLLM's engine core does the same.
            gc.freeze()

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str,
        config: EngineConfig | None = None,
        *,
        offload: OffloadCoordinator | None = None,
    ) -> LLMEngine:
        """Load the model (and tokenizer, when the folder has one); ``offload`` adds KV tiers.

        Resolved here, once: the dtype (``auto``: :mod:`pagedkv.engine.dtype`), the cache
        namespace (the checkpoint's fingerprint unless ``model_id`` is given), the chat
        template (``chat_template``, else the folder's) and the generation defaults."""
        return engine_wiring.engine_from_model_dir(cls, model_dir, config, offload)

    def default_sampling_params(self, **request: Any) -> SamplingParams:
        """``SamplingParams`` for a request's values, where a value left ``None`` takes the
        checkpoint's ``generation_config.json`` default (as vLLM's
        ``get_default_sampling_params``)."""
        return self.generation_defaults.sampling_params(**request)

    # ------------------------------------------------------------------ requests
    def add_request(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a request. Bad input raises a typed error and leaves the engine unchanged.

        ``cache_salt`` (a tenant's secret, as vLLM's) seeds the request's block-hash chain:
        it hits only blocks computed under the same salt, and its blocks only serve that salt.
        """
        params = params or SamplingParams()
        salt = check_cache_salt(cache_salt)
        if request_id in self._requests:
            raise InvalidRequestError(f"request {request_id!r} already exists")
        vocab = self.model.config.vocab_size
        ids = prompt_token_ids(request_id, prompt, self.tokenizer, vocab, self.max_model_len)
        grammar = check_features(params, self.tokenizer, vocab, self.structured_outputs)
        stops = stop_token_ids(params, self.eos_token_ids)
        text = prompt if isinstance(prompt, str) else None
        self._requests.add(request_id, params, ids, stops, grammar, salt, text)

    def structured_outputs(self) -> StructuredOutputManager:
        """The grammar engine over this model's tokenizer (built on first use)."""
        if self._structured is None:
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "structured output needs a tokenizer; this model has none"
                )
            self._structured = StructuredOutputManager(
                self.tokenizer.to_json(), self.model.config.vocab_size, self.eos_token_ids
            )
        return self._structured

    def abort(self, request_id: str) -> None:
        """Abort a request (all its samples) in any state."""
        self._requests.abort(request_id)

    def reset_prefix_cache(self, reset_running: bool = False) -> None:
        """Forget the device prefix cache (the KV tiers keep theirs). Raises CacheBusyError,
        changing nothing, while requests hold KV, unless ``reset_running`` preempts them first
        (they resume by recomputing, with the same tokens)."""
        self.scheduler.reset_prefix_cache(reset_running)

    def close(self) -> None:
        """Write queued blocks to the KV tiers and close them (nothing to do without tiers)."""
        if self.tier_io is not None:
            self.tier_io.close()
        if self.kv_publisher is not None:
            self._publish_kv_events()
            self.kv_publisher.close()

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ step
    def step(self) -> list[GenerationOutput]:
        """Run one scheduler step; return the state of every request that changed."""
        if self.proposer is not None:
            propose_drafts(self.scheduler, self.proposer, self._requests, self.max_model_len)
        out = self.scheduler.schedule()
        failed_loads = self._load_tier_blocks(out)
        sampled, failed = self._execute_and_sample(out)
        changed = self._requests.fail_samples(failed)  # finished before update, which skips them
        results = self._update(out, sampled, failed_loads)
        now = time.perf_counter()
        self._report_finished_in_schedule(out, changed)
        for r in results:
            self._apply_result(r, changed, now)
        if self.kv_publisher is not None:
            self._publish_kv_events()
        return [self._emit(g, now) for g in changed.values()]

    def _load_tier_blocks(self, out: SchedulerOutput) -> set[str]:
        """Fill this step's tier loads; return the loading requests whose load failed. A load
        that raises fails every load of the step: those requests recompute their prefix
        (``update`` rolls back their loaded-but-unfilled blocks, never commits them)."""
        if self.tier_io is None or not out.block_loads:
            return set()
        try:
            self.runner.ensure_blocks(max(b for b, _ in out.block_loads) + 1)
            return self.tier_io.load(self.scheduler, out, self.runner.kv_cache)
        except Exception:
            n = len(out.loading_ids)
            logger.exception("loading blocks from the KV tiers failed; %d requests recompute", n)
            self.tier_io.num_failed_loads += n
            return set(out.loading_ids)

    def _execute_and_sample(
        self, out: SchedulerOutput
    ) -> tuple[dict[str, list[int]], dict[str, Exception]]:
        """Run the model on the step and sample; returns the accepted tokens and the
        sequences that failed alone (the run, non-finite logits, or sampling)."""
        t0 = time.perf_counter()
        self._requests.mark_scheduled(out.scheduled, t0)
        ran = execute_isolating(self.runner.execute, out.scheduled, out.block_copies)
        if self.tier_io is not None and not ran.failed:  # the recompute cost a load must beat
            self.tier_io.observe_step(out.scheduled, time.perf_counter() - t0)
        logits = ran.logits
        failed = ran.failed | nonfinite_requests(logits)  # only these fail (see step_faults)
        for rid in failed:
            logits.pop(rid, None)
        if self.runner.prompt_logits_ids:
            take_prompt_logprobs(out.scheduled, logits, self.runner, self._requests)
        step = sample_step(  # every row left passed nonfinite_requests
            out.scheduled, logits, self._requests, self.structured_outputs, finite_logits=True
        )
        self.num_draft_tokens += step.num_draft_tokens
        self.num_accepted_draft_tokens += step.num_accepted_draft_tokens
        for rid, exc in step.unsampled.items():  # this request's parameters or mask failed alone
            failed[rid] = exc
        return step.sampled, failed

    def _update(
        self, out: SchedulerOutput, sampled: dict[str, list[int]], failed_loads: set[str]
    ) -> list[RequestOutput]:
        """Commit the step in the scheduler; offload the full blocks it computed."""
        to_store: list[tuple[int, bytes]] = []
        if self.tier_io is not None:
            accepted = {
                sr.request_id: len(sampled[sr.request_id]) - 1
                for sr in out.scheduled
                if sr.num_draft_tokens and sr.request_id in sampled
            }
            to_store = self.tier_io.blocks_to_store(self.scheduler, out.scheduled, accepted)
        results = self.scheduler.update(out, sampled, failed_loads=failed_loads)
        if self.tier_io is not None and to_store:
            self.tier_io.store(self.runner.kv_cache, to_store)
        return results

    def _report_finished_in_schedule(
        self, out: SchedulerOutput, changed: dict[str, RequestGroup]
    ) -> None:
        """Finish, with ``length``, the samples ``schedule()`` finished (each outgrew the pool
        alone)."""
        for rid in out.finished_ids:
            entry = self._requests.get(rid)
            # finished_ids also lists requests finished by the last update (already reported);
            # an id still known to the scheduler belongs to a new request that reuses it.
            if (
                entry is not None
                and entry[1].finish_reason is None
                and rid not in self.scheduler.requests
            ):
                entry[1].finish_reason = FinishReason.LENGTH
                release_text(entry[0], entry[1])
                changed[entry[0].request_id] = entry[0]

    def _apply_result(self, r: RequestOutput, changed: dict[str, RequestGroup], now: float) -> None:
        """One sequence's update: fork an ``n > 1`` parent after its prefill, else append its
        new tokens and their text."""
        group, smp = self._requests.owner(r.request_id)
        changed[group.request_id] = group
        if smp.index == 0:
            group.num_cached_tokens = r.num_cached_tokens
        if smp.force_token is not None:
            smp.force_token = None
            if r.finished:  # cannot happen with max_tokens + 1 >= 2; keep it finished
                smp.finish_reason = r.finish_reason
            else:
                self._requests.fork_samples(group, smp)
            return
        if group.first_token_s is None:
            group.first_token_s = now
        stop_token = r.finish_reason is FinishReason.STOP and bool(r.new_token_ids)
        stop_token = stop_token and r.new_token_ids[-1] in group.stop_token_ids
        append_tokens(
            self.scheduler, self.eos_token_ids, group, smp, r.new_token_ids, stop_token=stop_token
        )
        if r.finished and smp.finish_reason is None:
            smp.finish_reason = r.finish_reason
        release_text(group, smp)

    def _emit(self, group: RequestGroup, now: float) -> GenerationOutput:
        out = build_output(group, now)
        if out.finished:
            self._requests.retire(group)
        return out

    # ------------------------------------------------------------------ KV events
    def _publish_kv_events(self) -> None:
        assert self.kv_publisher is not None  # only called with KV events on
        publish_kv_events(self.kv_publisher, self.scheduler.manager.pool, self.tier_io)

    def kv_events_snapshot(self) -> tuple[int, list[bytes]]:
        """``(seq, hashes)``: the device pool's cached block hashes as of event batch ``seq``
        (pending events are published first, so every change so far is in a batch <= seq and
        none after it). Call between steps; KV events must be on."""
        assert self.kv_publisher is not None  # only called with KV events on
        return kv_events_snapshot(self.kv_publisher, self.scheduler.manager.pool, self.tier_io)

    def check_invariants(self) -> None:
        self._requests.check_invariants()
        self.scheduler.check_invariants()
        kv = self.runner.kv_cache
        kv.check_invariants()
        mgr = self.scheduler.manager
        for req in self.scheduler.running:  # tensors grow before a step uses a new block
            if req.num_computed_tokens and max(mgr.block_ids_view(req.request_id)) >= kv.num_blocks:
                raise InvariantViolation(f"E2: {req.request_id} holds a block past the KV tensors")


_stop_prefix_len = stop_prefix_len  # its name here before sample_output (tests import it)
