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

``n > 1`` samples share the prompt's KV through a copy-on-write fork. The first sample is
scheduled with the prompt minus its last token, and the engine "samples" that last token for it,
so after its prefill every sample has the same tokens and the same KV, with the last prompt
position still to compute. The other samples are forked there (full blocks shared by
reference, the partial last block copied on first write) and each computes the last prompt
position itself, so each draws its own first token from its own generator.
"""

from __future__ import annotations

import gc
import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagedkv.core.config import CacheConfig
from pagedkv.engine.batch_sampler import SampleInput, sample_batch
from pagedkv.engine.chat_template import load_chat_template
from pagedkv.engine.dtype import resolve_dtype
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.fingerprint import checkpoint_fingerprint
from pagedkv.engine.generation_config import GenerationDefaults, load_generation_defaults
from pagedkv.engine.gguf_loader import is_gguf_file, load_gguf_checkpoint
from pagedkv.engine.host_alloc import tune_host_allocator
from pagedkv.engine.kv_cache import KVCacheSpec, PagedKVCache, parse_dtype
from pagedkv.engine.loader import load_model
from pagedkv.engine.model_config import ModelConfig
from pagedkv.engine.models.llama import LlamaModel
from pagedkv.engine.outputs import CompletionOutput, GenerationOutput
from pagedkv.engine.runner import ModelRunner
from pagedkv.engine.sampler import SamplingParams, make_generator
from pagedkv.engine.samples import RequestGroup, SampleState
from pagedkv.engine.spec_decode import DraftProposer, NgramProposer, accept_drafts
from pagedkv.engine.step_faults import execute_isolating, nonfinite_requests
from pagedkv.engine.structured_output import StructuredOutputManager
from pagedkv.engine.tier_io import TierIO
from pagedkv.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from pagedkv.errors import (
    InvalidRequestError,
    InvariantViolation,
    ModelExecutionError,
    OverloadedError,
    PromptTooLongError,
    UnknownRequestError,
)
from pagedkv.sched import (
    FinishReason,
    Request,
    RequestStatus,
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from pagedkv.tiers.offload import OffloadCoordinator
from pagedkv.tiers.payload import TierLayout

if TYPE_CHECKING:
    from pagedkv.kvevents.publisher import ZmqEventPublisher

logger = logging.getLogger(__name__)


class LLMEngine:
    """Continuous-batching generation over paged KV.

    Invariants (``check_invariants()`` verifies each):
      E1  every live sample's ``seq_id`` maps back to its group in ``_samples``
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
        self.config = config
        max_len = config.max_model_len or mcfg.max_position_embeddings
        if max_len > mcfg.max_position_embeddings:
            raise InvalidRequestError(
                f"max_model_len {max_len} exceeds the model's max_position_embeddings "
                f"({mcfg.max_position_embeddings})"
            )
        if config.quantization is not None and model.quantization != config.quantization:
            model.quantize(config.quantization)  # here, so every loader's model gets it
        spec = KVCacheSpec(
            mcfg.num_hidden_layers,
            config.block_size,
            mcfg.num_key_value_heads,
            mcfg.head_dim,
            parse_dtype(config.dtype),
        )
        num_blocks = config.num_blocks
        if num_blocks is None:
            budget = config.kv_cache_bytes
            num_blocks = spec.num_blocks_for(budget) if budget is not None else 1024
        cache_cfg = CacheConfig(
            block_size=config.block_size,
            num_blocks=num_blocks,
            initial_blocks=config.initial_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            model_id=config.model_id,
            watermark=config.watermark,
            reservation=config.reservation,  # type: ignore[arg-type]  # validated by CacheConfig
            # every layer windowed: blocks before the window are released (core/config.py)
            sliding_window=mcfg.sliding_window if mcfg.all_layers_windowed else None,
            enable_events=config.kv_events is not None,
        )
        sched_cfg = SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            check_invariants=config.check_invariants,
        )
        layout = TierLayout(
            config.model_id or "model",
            mcfg.num_hidden_layers,
            mcfg.num_key_value_heads,
            mcfg.head_dim,
            config.block_size,
            str(spec.dtype).removeprefix("torch."),
        )
        self.tier_io = TierIO.try_build(config.tiers, layout, offload)  # closed by close()
        tier_index = None if self.tier_io is None else self.tier_io.offload
        self.scheduler = Scheduler(sched_cfg, cache_cfg, tier_index=tier_index)
        self.max_model_len = max_len
        self.kv_publisher = self._start_kv_events(config)  # closed by close()
        pool = self.scheduler.manager.pool
        kv = PagedKVCache(spec, pool.num_materialized_blocks, model.device)
        self.runner = ModelRunner(
            model,
            kv,
            batched_decode=config.batched_decode,
            max_num_blocks=num_blocks,
            decode_kernel=config.decode_kernel,
        )
        self.proposer: DraftProposer | None = (
            NgramProposer(config.num_speculative_tokens) if config.num_speculative_tokens else None
        )
        eos = set(mcfg.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        self.generation_defaults = GenerationDefaults()  # from_model_dir reads the checkpoint's
        self._seeds = None if config.seed is None else random.Random(config.seed)
        self._structured: StructuredOutputManager | None = None  # built on first use
        self._groups: dict[str, RequestGroup] = {}
        self._samples: dict[str, tuple[RequestGroup, SampleState]] = {}  # seq_id -> owner
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
        cfg = config or EngineConfig()
        device = _device(cfg.device)
        mcfg = ModelConfig.from_file(model_dir) if Path(model_dir).is_dir() else None
        cfg = replace(
            cfg, dtype=resolve_dtype(cfg.dtype, mcfg.torch_dtype if mcfg else "float32", device)
        )
        if is_gguf_file(model_dir):
            return cls._from_gguf(model_dir, cfg, offload=offload)
        model = load_model(model_dir, dtype=cfg.dtype, device=device)
        tok_dir = cfg.tokenizer or model_dir
        tok = None
        if cfg.tokenizer is not None or (Path(tok_dir) / "tokenizer.json").is_file():
            tok = Tokenizer(tok_dir)
        return cls._from_checkpoint(model_dir, model, tok, cfg, offload)

    @classmethod
    def _from_checkpoint(
        cls,
        path: str,
        model: LlamaModel,
        tok: Tokenizer | None,
        cfg: EngineConfig,
        offload: OffloadCoordinator | None,
    ) -> LLMEngine:
        """The engine of a loaded checkpoint (any format): its namespace (the fingerprint),
        the ``chat_template`` override, its generation defaults and their extra eos ids."""
        defaults = load_generation_defaults(path, cfg.generation_config)
        if tok is not None and cfg.chat_template is not None:
            tok.chat_template = load_chat_template(cfg.chat_template)
        cfg = replace(cfg, model_id=cfg.model_id or checkpoint_fingerprint(path))
        engine = cls(model, tok, cfg, offload=offload)
        engine.generation_defaults = defaults
        engine.eos_token_ids = tuple(sorted({*engine.eos_token_ids, *defaults.eos_token_ids}))
        for name, value in defaults.unsupported().items():
            logger.warning(
                "%s sets %s=%s, which pagedkv's sampler does not implement; it is not applied",
                defaults.source,
                name,
                value,
            )
        return engine

    def default_sampling_params(self, **request: Any) -> SamplingParams:
        """``SamplingParams`` for a request's values, where a value left ``None`` takes the
        checkpoint's ``generation_config.json`` default (as vLLM's
        ``get_default_sampling_params``)."""
        return self.generation_defaults.sampling_params(**request)

    @classmethod
    def _from_gguf(
        cls, path: str, cfg: EngineConfig, *, offload: OffloadCoordinator | None
    ) -> LLMEngine:
        """A GGUF file: model, tokenizer and (unless given) a model id from its content."""
        ckpt = load_gguf_checkpoint(path, dtype=cfg.dtype, device=_device(cfg.device))
        if not cfg.model_id:
            cfg = replace(cfg, model_id=ckpt.fingerprint)
        tok = Tokenizer(cfg.tokenizer) if cfg.tokenizer is not None else ckpt.tokenizer
        return cls._from_checkpoint(path, ckpt.model, tok, cfg, offload)

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> None:
        """Queue a request. Bad input raises a typed error and leaves the engine unchanged."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise InvalidRequestError(f"request {request_id!r} already exists")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InvalidRequestError(f"request {request_id!r} has an empty prompt")
        vocab = self.model.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"prompt token ids outside [0, {vocab}): {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; this model has none")
        grammar = self._check_features(params)
        stops = set(params.stop_token_ids)
        if not params.ignore_eos:
            stops.update(self.eos_token_ids)
        group = RequestGroup(request_id, params, ids, tuple(sorted(stops)), time.perf_counter())
        group.grammar = grammar
        fork = params.n > 1 and len(ids) > 1 and ids[-1] not in stops
        if fork:  # see the module docstring: the last prompt token is "sampled" for sample 0
            sample0 = self._new_sample(group, 0, force_token=ids[-1])
            req = self._make_request(sample0.seq_id, ids[:-1], params.max_tokens + 1, group)
        else:
            sample0 = self._new_sample(group, 0)
            req = self._make_request(sample0.seq_id, ids, params.max_tokens, group)
        self.scheduler.add_request(req)  # may raise PromptTooLongError: nothing registered yet
        self._register(group, sample0)
        self._groups[request_id] = group
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None]  # the first token has no context
            self.runner.prompt_logits_ids.add(sample0.seq_id)
        if not fork:
            for i in range(1, params.n):
                self._add_independent(group, i)

    def _check_features(self, params: SamplingParams) -> str | None:
        """Refuse what this engine cannot honour; return the compiled grammar, if any."""
        vocab = self.model.config.vocab_size
        ids = [t for t, _ in params.logit_bias] + list(params.stop_token_ids)
        bad = [t for t in ids if t >= vocab]
        if bad:
            raise InvalidRequestError(
                f"token ids outside [0, {vocab}) in logit_bias or stop_token_ids: {bad[:5]}"
            )
        if params.prompt_logprobs is not None and params.n > 1:
            raise InvalidRequestError("prompt_logprobs with n > 1 is not supported")
        if params.structured_outputs is None:
            return None
        return self.structured_outputs().compile(params.structured_outputs)

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
        group = self._groups.pop(request_id, None)
        if group is None:
            raise UnknownRequestError(f"unknown request {request_id!r}")
        for s in group.samples:
            self._samples.pop(s.seq_id, None)
            self.runner.prompt_logits_ids.discard(s.seq_id)
            if s.finish_reason is None and s.seq_id in self.scheduler.requests:
                self.scheduler.abort(s.seq_id)

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
        return bool(self._groups)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------------ step
    def step(self) -> list[GenerationOutput]:
        """Run one scheduler step; return the state of every request that changed."""
        sched = self.scheduler
        if self.proposer is not None:
            self._propose_drafts()
        out = sched.schedule()
        failed_loads = self._load_tier_blocks(out)
        t0 = time.perf_counter()
        self._mark_scheduled(out.scheduled, t0)
        ran = execute_isolating(self.runner.execute, out.scheduled, out.block_copies)
        if self.tier_io is not None and not ran.failed:  # the recompute cost a load must beat
            self.tier_io.observe_step(out.scheduled, time.perf_counter() - t0)
        logits = ran.logits
        failed = ran.failed | nonfinite_requests(logits)  # only these fail (see step_faults)
        for rid in failed:
            logits.pop(rid, None)
        if self.runner.prompt_logits_ids:
            self._take_prompt_logprobs(out.scheduled, logits)
        sampled, unsampled = self._sample(out.scheduled, logits)
        for rid, exc in unsampled.items():  # this request's parameters or mask failed alone
            failed[rid] = exc
        changed = self._fail_samples(failed)  # finished before update, which then skips them
        to_store: list[tuple[int, bytes]] = []
        if self.tier_io is not None:
            accepted = {
                sr.request_id: len(sampled[sr.request_id]) - 1
                for sr in out.scheduled
                if sr.num_draft_tokens and sr.request_id in sampled
            }
            to_store = self.tier_io.blocks_to_store(sched, out.scheduled, accepted)
        results = sched.update(out, sampled, failed_loads=failed_loads)
        if self.tier_io is not None and to_store:
            self.tier_io.store(self.runner.kv_cache, to_store)
        now = time.perf_counter()
        for rid in out.finished_ids:  # finished inside schedule(): it outgrew the pool alone
            entry = self._samples.get(rid)
            # finished_ids also lists requests finished by the last update (already reported);
            # an id still known to the scheduler belongs to a new request that reuses it.
            if entry is not None and entry[1].finish_reason is None and rid not in sched.requests:
                entry[1].finish_reason = FinishReason.LENGTH
                self._release_text(entry[0], entry[1])
                changed[entry[0].request_id] = entry[0]
        for r in results:
            group, smp = self._samples[r.request_id]
            changed[group.request_id] = group
            if smp.index == 0:
                group.num_cached_tokens = r.num_cached_tokens
            if smp.force_token is not None:
                smp.force_token = None
                if r.finished:  # cannot happen with max_tokens + 1 >= 2; keep it finished
                    smp.finish_reason = r.finish_reason
                else:
                    self._fork_samples(group, smp)
                continue
            if group.first_token_s is None:
                group.first_token_s = now
            stop_token = r.finish_reason is FinishReason.STOP and bool(r.new_token_ids)
            stop_token = stop_token and r.new_token_ids[-1] in group.stop_token_ids
            self._append(group, smp, r.new_token_ids, stop_token=stop_token)
            if r.finished and smp.finish_reason is None:
                smp.finish_reason = r.finish_reason
            self._release_text(group, smp)
        if self.kv_publisher is not None:
            self._publish_kv_events()
        return [self._emit(g, now) for g in changed.values()]

    # ------------------------------------------------------------------ KV events
    def _start_kv_events(self, config: EngineConfig) -> ZmqEventPublisher | None:
        if config.kv_events is None:
            return None
        from pagedkv.kvevents.publisher import ZmqEventPublisher  # needs pyzmq, msgspec

        if self.tier_io is not None:
            for tier in self.tier_io.offload.tiers:
                tier.enable_events()
        return ZmqEventPublisher(config.kv_events)

    def _publish_kv_events(self) -> None:
        """Hand the pool's events, then each tier's, to the publisher as one batch (it never
        blocks; a full queue drops the batch and counts it). Tier events written by the
        offload thread between steps go out with the next step's batch."""
        assert self.kv_publisher is not None  # only called with KV events on
        events = self.scheduler.manager.pool.drain_events()
        if self.tier_io is not None:
            for tier in self.tier_io.offload.tiers:
                events.extend(tier.drain_events())
        self.kv_publisher.publish(events)

    def kv_events_snapshot(self) -> tuple[int, list[bytes]]:
        """``(seq, hashes)``: the device pool's cached block hashes as of event batch ``seq``
        (pending events are published first, so every change so far is in a batch <= seq and
        none after it). Call between steps; KV events must be on."""
        assert self.kv_publisher is not None  # only called with KV events on
        self._publish_kv_events()
        pool = self.scheduler.manager.pool
        hashes = [pool.block_hash(i) for i in range(pool.num_materialized_blocks)]
        return self.kv_publisher.last_seq, [h for h in hashes if h is not None]

    # ------------------------------------------------------------------ internals
    def _sample(
        self, scheduled: Sequence[ScheduledRequest], logits: dict[str, torch.Tensor]
    ) -> tuple[dict[str, list[int]], dict[str, Exception]]:
        """Sample every sampling sequence of the step in one batch; verify drafts. Returns
        the accepted tokens and the sequences no token could be drawn for (with why)."""
        sampled: dict[str, list[int]] = {}
        todo: list[tuple[ScheduledRequest, SampleState]] = []
        for sr in scheduled:
            if not sr.samples or sr.request_id not in logits:
                continue
            group, smp = self._samples[sr.request_id]
            if smp.force_token is not None:
                sampled[sr.request_id] = [smp.force_token]
            else:
                todo.append((sr, smp))
        guided = [(smp, smp.grammar) for _, smp in todo if smp.grammar is not None]
        masks = None
        if guided:
            masks = self.structured_outputs().fill_bitmasks([g for _, g in guided])
        row_of = {id(smp): i for i, (smp, _) in enumerate(guided)}
        inputs = []
        for sr, smp in todo:
            group = self._samples[sr.request_id][0]
            mask = None if masks is None or smp.grammar is None else masks[row_of[id(smp)]]
            rows = logits[sr.request_id]
            inputs.append(
                SampleInput(
                    rows,
                    group.params,
                    smp.generator,
                    group.prompt_token_ids,
                    smp.token_ids,
                    group.stop_token_ids,
                    mask,
                )
            )
        unsampled: dict[str, Exception] = {}
        for (sr, smp), res in zip(todo, sample_batch(inputs), strict=True):
            if res.error is not None:
                logger.error("request %s cannot be sampled: %s", sr.request_id, res.error)
                unsampled[sr.request_id] = ModelExecutionError(res.error)
                continue
            toks = res.token_ids
            if sr.num_draft_tokens:
                drafts = sr.token_ids[1:]
                toks = accept_drafts(drafts, toks)
                self.num_draft_tokens += len(drafts)
                self.num_accepted_draft_tokens += len(toks) - 1
            sampled[sr.request_id] = toks
            smp.pending_logprobs = [] if res.logprobs is None else res.logprobs[: len(toks)]
        return sampled, unsampled

    def _take_prompt_logprobs(
        self, scheduled: Sequence[ScheduledRequest], logits: dict[str, torch.Tensor]
    ) -> None:
        """Record the prompt logprobs of this step's prefill chunks and leave only sampling
        rows in ``logits``. Position ``p`` predicts prompt token ``p + 1``; positions already
        recorded (a recompute after preemption) are skipped."""
        for sr in scheduled:
            rid = sr.request_id
            if rid not in self.runner.prompt_logits_ids or rid not in logits:
                continue
            rows = logits.pop(rid)
            if sr.samples:
                logits[rid] = rows[-1:]
                self.runner.prompt_logits_ids.discard(rid)  # the prompt is complete
            self._samples[rid][0].record_prompt_logprobs(sr.start_position, rows)

    def _new_sample(
        self, group: RequestGroup, index: int, force_token: int | None = None
    ) -> SampleState:
        seq_id = group.request_id if group.params.n == 1 else f"{group.request_id}#{index}"
        seed = group.params.seed
        if seed is None and self._seeds is not None:  # EngineConfig.seed: reproducible runs
            seed = self._seeds.getrandbits(62)
        gen = make_generator(None if seed is None else seed + index, self.model.device)
        detok = None
        if self.tokenizer is not None:
            skip = group.params.skip_special_tokens
            detok = IncrementalDetokenizer(
                self.tokenizer, group.prompt_token_ids, skip_special_tokens=skip
            )
        smp = SampleState(seq_id, index, gen, detok, force_token)
        if group.grammar is not None:
            smp.grammar = self.structured_outputs().matcher(group.grammar)
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
        salt = None if group.params.prompt_logprobs is None else f"prompt-logprobs/{seq_id}"
        return Request(
            seq_id,
            ids,
            max_tokens=max_tokens,
            stop_token_ids=group.stop_token_ids,
            arrival_time=group.arrival_s,
            cache_salt=salt,
        )

    def _add_independent(self, group: RequestGroup, index: int) -> None:
        smp = self._new_sample(group, index)
        req = self._make_request(smp.seq_id, group.prompt_token_ids, group.params.max_tokens, group)
        self.scheduler.add_request(req)
        self._register(group, smp)

    def _fork_samples(self, group: RequestGroup, parent: SampleState) -> None:
        """Fork samples 1..n-1 from sample 0 right after its prefill (copy-on-write)."""
        sched = self.scheduler
        for i in range(1, group.params.n):
            smp = self._new_sample(group, i)
            try:
                sched.fork(parent.seq_id, smp.seq_id)
            except OverloadedError:  # max_num_seqs reached: queue it as its own request instead
                self._add_independent(group, i)
                continue
            self._register(group, smp)

    def _propose_drafts(self) -> None:
        assert self.proposer is not None  # only called when speculation is on
        for req in self.scheduler.running:
            if req.num_computed_tokens != req.num_tokens - 1:
                continue
            entry = self._samples.get(req.request_id)
            if entry is not None and entry[0].params.depends_on_history:
                continue  # each draft row would need its own history (see batch_sampler)
            room = req.max_tokens - req.num_output_tokens - 1
            room = min(room, self.max_model_len - req.num_tokens - 1)
            req.draft_token_ids = self.proposer.propose(req.all_token_ids, room) if room > 0 else []

    def _append(
        self,
        group: RequestGroup,
        smp: SampleState,
        new_ids: Sequence[int],
        *,
        stop_token: bool = False,
    ) -> None:
        """Add sampled tokens and their text; a stop string cuts the text and finishes. A
        stop token (``stop_token``: the last id ended the sample) is kept in the token ids but
        not in the text unless ``include_stop_str_in_output`` (vLLM's rule)."""
        smp.token_ids.extend(new_ids)
        smp.delta_ids.extend(new_ids)
        if smp.logprobs is not None:
            got = smp.pending_logprobs[: len(new_ids)]
            smp.logprobs.extend(got)
            smp.delta_logprobs.extend(got)
            smp.pending_logprobs = []
        if smp.grammar is not None:
            reason = smp.advance_grammar(new_ids, self.eos_token_ids)
            if reason is not None:
                self._finish_running(smp.seq_id, reason)
        if smp.detok is None:
            return
        params = group.params
        shown = new_ids[:-1] if stop_token and not params.include_stop_str_in_output else new_ids
        delta = smp.detok.add(shown)
        stops = params.stop
        if not stops or smp.finish_reason is not None or len(smp.token_ids) < params.min_tokens:
            smp.text += delta
            return
        old_len = len(smp.text)
        text = smp.text + delta
        window = max(0, old_len - max(len(s) for s in stops) + 1)
        hits = [(i, len(s)) for i, s in ((text.find(s, window), s) for s in stops) if i >= 0]
        if hits:
            at, length = min(hits)
            text = text[: at + length] if params.include_stop_str_in_output else text[:at]
            smp.finish_reason = FinishReason.STOP
            self._finish_running(smp.seq_id, FinishReason.STOP)
        smp.text = text

    def _finish_running(self, seq_id: str, reason: FinishReason) -> None:
        req = self.scheduler.requests.get(seq_id)
        if req is not None and req.status is RequestStatus.RUNNING:
            self.scheduler.finish(seq_id, reason)

    @staticmethod
    def _release_text(group: RequestGroup, smp: SampleState) -> None:
        """Move text into the streaming delta, holding back a tail that could still begin a
        stop string (it may be cut by the next token); everything is released at the end."""
        end = len(smp.text)
        stops = group.params.stop
        if stops and smp.finish_reason is None:
            end -= _stop_prefix_len(smp.text, stops)
        if end > smp.num_released_chars:
            smp.delta_text += smp.text[smp.num_released_chars : end]
            smp.num_released_chars = end

    def _emit(self, group: RequestGroup, now: float) -> GenerationOutput:
        comps = []
        for s in group.samples:
            comps.append(
                CompletionOutput(
                    s.index,
                    s.text,
                    tuple(s.token_ids),
                    s.delta_text,
                    tuple(s.delta_ids),
                    None if s.finish_reason is None else s.finish_reason.value,
                    None if s.logprobs is None else tuple(s.logprobs),
                    tuple(s.delta_logprobs),
                )
            )
            s.delta_ids = []
            s.delta_text = ""
            s.delta_logprobs = []
        n = group.params.n
        finished = len(group.samples) == n and all(s.finish_reason for s in group.samples)
        if finished:
            del self._groups[group.request_id]
            for s in group.samples:
                self._samples.pop(s.seq_id, None)
                self.runner.prompt_logits_ids.discard(s.seq_id)
        ttft = None if group.first_token_s is None else group.first_token_s - group.arrival_s
        queued = group.first_scheduled_s
        return GenerationOutput(
            group.request_id,
            tuple(group.prompt_token_ids),
            tuple(sorted(comps, key=lambda c: c.index)),
            finished,
            group.num_cached_tokens,
            ttft,
            now - group.arrival_s,
            None if group.prompt_logprobs is None else tuple(group.prompt_logprobs),
            None if queued is None else queued - group.arrival_s,
        )

    def _mark_scheduled(self, scheduled: Sequence[ScheduledRequest], now: float) -> None:
        """Record when each request's first sequence was first scheduled (its queue time)."""
        for sr in scheduled:
            entry = self._samples.get(sr.request_id)
            if entry is not None and entry[0].first_scheduled_s is None:
                entry[0].first_scheduled_s = now

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

    def _fail_samples(self, failures: Mapping[str, Exception]) -> dict[str, RequestGroup]:
        """Finish each failed sample (and the rest of its group) with ``"error"``; returns the
        groups to report. Call before ``update`` so that it skips them."""
        changed: dict[str, RequestGroup] = {}
        for sid in failures:
            group, smp = self._samples[sid]
            req = self.scheduler.requests.get(sid)
            if req is not None and req.status is RequestStatus.RUNNING:
                self.scheduler.finish(sid, FinishReason.ERROR)
            smp.finish_reason = FinishReason.ERROR
            for other in group.samples:  # a group cannot complete without its failed sample
                if other.finish_reason is None:
                    if other.seq_id in self.scheduler.requests:
                        self.scheduler.abort(other.seq_id)
                    other.finish_reason = FinishReason.ERROR
            while len(group.samples) < group.params.n:
                missing = self._new_sample(group, len(group.samples))
                missing.finish_reason = FinishReason.ERROR
                self._register(group, missing)
            changed[group.request_id] = group
        return changed

    def check_invariants(self) -> None:
        for sid, (group, smp) in self._samples.items():
            if smp.seq_id != sid or self._groups.get(group.request_id) is not group:
                raise InvariantViolation(f"E1: sample {sid} is not owned by a live group")
        self.scheduler.check_invariants()
        kv = self.runner.kv_cache
        kv.check_invariants()
        mgr = self.scheduler.manager
        for req in self.scheduler.running:  # tensors grow before a step uses a new block
            if req.num_computed_tokens and max(mgr.block_ids_view(req.request_id)) >= kv.num_blocks:
                raise InvariantViolation(f"E2: {req.request_id} holds a block past the KV tensors")


def _stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest


def _device(name: str) -> torch.device:
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InvalidRequestError(f"device {name!r} was asked for but CUDA is not available")
    return torch.device(name)
