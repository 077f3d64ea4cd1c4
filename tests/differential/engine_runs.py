"""Shared pieces of the differential tests: a scheduled step entry built by hand, and greedy
runs of pagedkv's engine and of transformers' ``generate`` on the same prompts."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.sampler import SamplingParams
from pagedkv.sched.output import ScheduledRequest


def scheduled(
    rid: str, table: np.ndarray, bs: int, start: int, tokens: list[int]
) -> ScheduledRequest:
    """``tokens`` at positions ``start..`` of request ``rid`` with block table ``table`` (block
    size ``bs``): the slot mapping computed from the table; a prompt chunk (``is_prefill``)
    when ``start`` is 0 or it has several tokens, else a decode (the scheduler marks only a
    speculative decode's several tokens as not a prefill)."""
    pos = np.arange(start, start + len(tokens))
    slots = (table[pos // bs] * bs + pos % bs).astype(np.int32)
    prefill = start == 0 or len(tokens) > 1
    return ScheduledRequest(rid, start, tokens, len(tokens), table, slots, prefill, True)


def engine_greedy(engine: LLMEngine, prompts: list[list[int]], new: int) -> list[list[int]]:
    """Each prompt's ``new`` greedy tokens from ``engine``, the prompts decoding together."""
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = list(out.outputs[0].token_ids)
    return [got[f"r{i}"] for i in range(len(prompts))]


def greedy_logprobs(
    engine: LLMEngine, prompts: list[list[int]], passes: int = 1, max_tokens: int = 6
) -> tuple[list[list[tuple[int, float]]], int]:
    """Run ``prompts`` together ``passes`` times (a later pass can hit the prefix cache);
    returns the last pass's greedy ``(token_id, logprob)`` pairs per prompt, and the cached
    prompt tokens over all passes."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=3)
    got: dict[str, list[tuple[int, float]]] = {}
    cached = 0
    for p in range(passes):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"p{p}r{i}", prompt, params)
        done, hits = drain(engine)
        got.update(done)
        cached += hits
    return [got[f"p{passes - 1}r{i}"] for i in range(len(prompts))], cached


def drain(engine: LLMEngine) -> tuple[dict[str, list[tuple[int, float]]], int]:
    """Step until every request finished: each one's (token, log-probability) pairs by request
    id (requests need ``logprobs``), and the prompt tokens served from the cache, summed."""
    got: dict[str, list[tuple[int, float]]] = {}
    cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                lps = out.outputs[0].logprobs
                assert lps is not None
                got[out.request_id] = [(t.token_id, t.logprob) for t in lps]
                cached += out.num_cached_tokens
    return got, cached


def hf_greedy(hf: Any, prompt: list[int], new: int) -> list[int]:
    """``prompt``'s ``new`` greedy tokens from transformers' ``generate`` (the reference)."""
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )
    return list(ref[0, len(prompt) :].tolist())
