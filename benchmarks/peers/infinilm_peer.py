"""InfiniLM's scheduler admission check, block manager and block hashing on pagedkv's fixtures.

``--peer-infinilm PATH``: PATH is an InfiniLM checkout (repository InfiniTensor/InfiniLM); its
``python/infinilm/llm/{scheduler,cache_manager,prefix_cache,request,sampling_params}.py`` are
loaded from there, without running the package ``__init__`` (which loads the C++ engine). They
need ``janus`` (``pip install janus``), as InfiniLM itself does. No stand-ins are needed.

admission  The same state as pagedkv's fixture, built through InfiniLM's own API: running
           requests (16 prompt tokens, max_tokens=128, 64 generated with
           ``append_generated_token_id``) hold 5 pages each and sit in the scheduler's running
           queue; filler block tables take every other page and are published under their
           hashes; whole fillers are then released (``free_blocks``) until half the pages have
           no reference (they stay cached, as InfiniLM keeps them). The candidate (128 prompt
           tokens, its first 64 a released filler's, max_tokens=128) has its prefix matched once
           beforehand (``get_computed_blocks``). Timed: 32 ``Scheduler.can_accept_request``
           calls per group, 5 rounds of 5 groups after 5 warm-up groups.
prefix     ``get_computed_blocks`` + ``allocate_slots`` of a prompt whose blocks a finished
           request published; hashes computed untimed; ``free_blocks`` untimed.
hash       ``InferenceRequest.initialize_block_hashes`` over the 32K-token prompt, per block
           (xxh3-128 over a schema tag, the parent, a length and the int32 tokens).
"""

from __future__ import annotations

import importlib
import random
import types
from pathlib import Path
from typing import Any

from _harness import Case
from peers._loader import PeerImporter, install

BLOCK_SIZE = 16
REAL = (
    "infinilm.llm.prefix_cache",
    "infinilm.llm.cache_manager",
    "infinilm.llm.sampling_params",
    "infinilm.llm.request",
    "infinilm.llm.scheduler",
)


class InfiniLMPeer:
    """InfiniLM's modules loaded from a checkout, and its cases for bench_core's fixtures."""

    def __init__(self, mods: dict[str, types.ModuleType]) -> None:
        self.mods = mods

    def cases(self, fixture: str, quick: bool) -> list[Case]:
        builders = {
            "admission": self.admission_cases,
            "prefix": self.prefix_cases,
            "hash": self.hash_cases,
            "decode": self.decode_cases,
        }
        return builders[fixture](quick) if fixture in builders else []

    def _request(self, rid: str, tokens: list[int], max_tokens: int = 0) -> Any:
        req_mod = self.mods["request"]
        params = self.mods["sampling_params"].SamplingParams(max_tokens=max_tokens)
        req = req_mod.InferenceRequest(rid, prompt_token_ids=tokens, sampling_params=params)
        req.initialize_block_hashes(BLOCK_SIZE, True)
        return req

    def build_admission(self, pages: int, running: int, seed: int = 0) -> tuple[Any, Any, int]:
        from bench_core import (
            CANDIDATE_MAX_TOKENS,
            CANDIDATE_PROMPT_TOKENS,
            FILLER_BLOCKS,
            RUNNING_GENERATED,
            RUNNING_MAX_TOKENS,
            RUNNING_PROMPT_TOKENS,
            VOCAB,
        )

        rng = random.Random(seed)
        sched = self.mods["scheduler"].Scheduler(
            max_batch_size=running, num_blocks=pages, block_size=BLOCK_SIZE
        )
        cm = sched.cache_manager
        for i in range(running):
            toks = [rng.randrange(VOCAB) for _ in range(RUNNING_PROMPT_TOKENS)]
            req = self._request(f"run{i}", toks, RUNNING_MAX_TOKENS)
            for _ in range(RUNNING_GENERATED):
                req.append_generated_token_id(rng.randrange(VOCAB))
            total = RUNNING_PROMPT_TOKENS + RUNNING_GENERATED
            out = cm.allocate_slots(total)
            if out is None:
                raise ValueError(f"{running} running requests do not fit in {pages} pages")
            req.block_table = out[0]
            cm.publish_computed_blocks(req.block_table, req.block_hashes, 0, total)
            sched.running_queue.sync_q.put(req)
        fillers: list[tuple[list[int], list[int]]] = []
        while cm.get_num_free_blocks():
            n = min(FILLER_BLOCKS, cm.get_num_free_blocks())
            toks = [rng.randrange(VOCAB) for _ in range(n * BLOCK_SIZE)]
            req = self._request(f"fill{len(fillers)}", toks)
            table, _ = cm.allocate_slots(len(toks))
            cm.publish_computed_blocks(table, req.block_hashes, 0, len(toks))
            fillers.append((table, toks))
        released: list[list[int]] = []
        num_released = 0  # == cm.get_total_usable_blocks(), which scans every page
        while fillers and num_released < pages // 2:
            table, toks = fillers.pop()
            cm.free_blocks(table)
            released.append(toks)
            num_released += len(table)
        shared = released[0][:64] if released else []
        cand_toks = shared + [rng.randrange(VOCAB) for _ in range(CANDIDATE_PROMPT_TOKENS - 64)]
        cand = self._request("candidate", cand_toks, CANDIDATE_MAX_TOKENS)
        _, num_local = cm.get_computed_blocks(cand.block_hashes, len(cand_toks) - 1)
        return sched, cand, num_local

    def decode_cases(self, quick: bool) -> list[Case]:
        """bench_sched's decode fixture on InfiniLM's ``Scheduler`` (see ``_infinilm_step``)."""
        from bench_sched import (
            DECODE_ROUNDS,
            DECODE_SIZES,
            MAX_TOKENS,
            PROMPT_TOKENS,
            VOCAB,
            _blocks_for,
            decode_steps,
        )

        finished = self.mods["request"].FinishReason.LENGTH
        cases: list[Case] = []
        for n in DECODE_SIZES[:2] if quick else DECODE_SIZES:
            rng = random.Random(0)
            sched = self.mods["scheduler"].Scheduler(
                max_batch_size=n,
                num_blocks=_blocks_for(n) + n,
                block_size=BLOCK_SIZE,
                max_num_batched_tokens=max(8192, n * PROMPT_TOKENS),
            )
            for i in range(n):
                prompt = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
                sched.add_request(self._request(f"run{i}", prompt, MAX_TOKENS))
            for _ in range(64):  # prefill batches until every request decodes
                if sched.waiting_queue.sync_q.qsize() == 0:
                    break
                _infinilm_step(sched, finished)

            def check(sched: Any = sched, n: int = n) -> None:
                out = _infinilm_step(sched, finished)
                if out is None or out.is_prefill or len(out.scheduled_requests) != n:
                    raise RuntimeError("InfiniLM decode fixture: not a steady decode step")

            steps = decode_steps(n)
            cases.append(
                Case(
                    "decode",
                    f"running={n:,}",
                    "infinilm",
                    "step",
                    lambda sched=sched: _infinilm_step(sched, finished),
                    calls_per_round=steps,
                    rounds=3 if quick else DECODE_ROUNDS,
                    warmup=steps,
                    params={"running": n, "prompt_tokens": PROMPT_TOKENS, "steps_per_round": steps},
                    note="Scheduler.schedule + update",
                    check=check,
                    interleave="decode",  # with pagedkv's decode rows, every size alike
                )
            )
        return cases

    def admission_cases(self, quick: bool) -> list[Case]:
        from bench_core import ADMISSION_PAGES, ADMISSION_RUNNING, CHECKS_PER_GROUP

        cases: list[Case] = []
        for running in ADMISSION_RUNNING[:1] if quick else ADMISSION_RUNNING:
            for pages in ADMISSION_PAGES[:2] if quick else ADMISSION_PAGES:
                try:
                    sched, cand, num_local = self.build_admission(pages, running)
                except ValueError as exc:
                    print(f"infinilm admission pages={pages} running={running}: skipped ({exc})")
                    continue
                admits = sched.can_accept_request(cand, num_local)

                def group(
                    check: Any = sched.can_accept_request, c: Any = cand, n: int = num_local
                ) -> None:
                    for _ in range(CHECKS_PER_GROUP):
                        check(c, n)

                cases.append(
                    Case(
                        "admission",
                        f"pages={pages:,} running={running:,}",
                        "infinilm",
                        "check",
                        group,
                        ops=CHECKS_PER_GROUP,
                        calls_per_round=5,
                        rounds=5,
                        warmup=5,
                        params={"pages": pages, "running": running, "admits": admits},
                        note=f"can_accept_request, admits={admits}",
                        # Not interleaved with pagedkv's cases: a round of this walks every
                        # page and evicts pagedkv's state from the CPU caches, which would
                        # bias the flatness of pagedkv's rows (the ratio is 60x-6000x anyway).
                        interleave="admission-infinilm",
                    )
                )
        return cases

    def prefix_cases(self, quick: bool) -> list[Case]:
        from bench_core import PREFIX_LENGTHS, prefix_prompt

        cases: list[Case] = []
        for num_tokens in PREFIX_LENGTHS[:1] if quick else PREFIX_LENGTHS:
            prompt = prefix_prompt(num_tokens)
            cm = self.mods["cache_manager"].BlockManager(
                2 * num_tokens // BLOCK_SIZE + 64, BLOCK_SIZE
            )
            warm = self._request("warm", prompt)
            table, _ = cm.allocate_slots(num_tokens)
            cm.publish_computed_blocks(table, warm.block_hashes, 0, num_tokens)
            cm.free_blocks(table)  # every full block is now cached, unreferenced
            st: dict[str, Any] = {"n": 0}

            def setup(st: dict[str, Any] = st, prompt: list[int] = prompt) -> None:
                st["n"] += 1
                st["req"] = self._request(f"r{st['n']}", prompt)

            def op(st: dict[str, Any] = st, cm: Any = cm, n: int = num_tokens) -> None:
                cached, hit = cm.get_computed_blocks(st["req"].block_hashes, n - 1)
                st["out"] = cm.allocate_slots(n - hit, hit, cached)
                st["hit"] = hit

            def check(st: dict[str, Any] = st, n: int = num_tokens) -> None:
                if st["out"] is None or st["hit"] != (n - 1) // BLOCK_SIZE * BLOCK_SIZE:
                    raise RuntimeError(f"InfiniLM prefix fixture hit {st['hit']} tokens, not all")

            cases.append(
                Case(
                    "prefix",
                    f"cached prompt={num_tokens:,} tokens",
                    "infinilm",
                    "prompt",
                    op,
                    setup=setup,
                    teardown=lambda st=st, cm=cm: cm.free_blocks(st["out"][0]),
                    rounds=5 if quick else 21,
                    warmup=2,
                    params={"prompt_tokens": num_tokens},
                    note="BlockManager (+ slot mapping)",
                    check=check,
                )
            )
        return cases

    def hash_cases(self, quick: bool) -> list[Case]:
        from bench_core import HASH_TOKENS, HASH_TOKENS_QUICK, prefix_prompt

        num_tokens = HASH_TOKENS_QUICK if quick else HASH_TOKENS
        prompt = prefix_prompt(num_tokens, seed=2)
        req_mod, params = self.mods["request"], self.mods["sampling_params"].SamplingParams()
        reqs: list[Any] = []
        return [
            Case(
                "hash",
                f"xxh3_128, {num_tokens:,}-token prompt",
                "infinilm",
                "block",
                lambda: reqs[-1].initialize_block_hashes(BLOCK_SIZE, True),
                ops=num_tokens // BLOCK_SIZE,
                setup=lambda: reqs.append(
                    req_mod.InferenceRequest("h", prompt_token_ids=prompt, sampling_params=params)
                ),
                teardown=reqs.clear,
                rounds=5 if quick else 11,
                warmup=2,
                params={"algo": "xxh3_128", "prompt_tokens": num_tokens},
                note="initialize_block_hashes",
            )
        ]


def _infinilm_step(sched: Any, finished: Any) -> Any:
    """One InfiniLM step without a model: ``schedule()``, then what its engine's
    ``_update_requests`` does per request minus detokenization (commit the computed boundary,
    append one sampled token, the max_tokens check), then ``complete_requests`` (re-queue)."""
    out = sched.schedule()
    reqs = out.scheduled_requests
    commit = sched.commit_computed_tokens
    for req in reqs:
        commit(req, req.get_total_length())
        req.append_generated_token_id(7)
        if req.get_num_generated_tokens() >= req.sampling_params.max_tokens:
            req.mark_finished(finished)
    sched.complete_requests(reqs)
    return out


def load(path: str) -> InfiniLMPeer:
    """Load InfiniLM's scheduler and cache manager from the checkout at ``path``."""
    given = Path(path).expanduser().resolve()
    # Accept the checkout, its python/ folder, or python/infinilm/llm itself.
    candidates = [given / "python", given, given.parent.parent]
    tree = next(
        (t for t in candidates if (t / "infinilm" / "llm" / "cache_manager.py").is_file()), None
    )
    if tree is None:
        raise OSError(
            f"{given} is not an InfiniLM checkout (no python/infinilm/llm/cache_manager.py)"
        )
    install(PeerImporter("infinilm", tree, REAL, {}))
    names = {n.rsplit(".", 1)[1]: n for n in REAL}
    return InfiniLMPeer({k: importlib.import_module(v) for k, v in names.items()})
