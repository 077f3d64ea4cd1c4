"""Caching, chunking, block size, preemption, forks and speculation never change greedy outputs.

Every configuration is compared with transformers' greedy ``generate`` on the same tiny
random checkpoint, so "identical" means identical to a trusted implementation, not merely to
another run of the engine.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from differential.engine_runs import drain, hf_greedy
from differential.hf_models import build_hf_model
from pagedkv.engine.engine_config import EngineConfig
from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.loader import load_model
from pagedkv.engine.sampler import SamplingParams

pytest.importorskip("transformers")

MAX_TOKENS = 10
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(0, 128, (37,), generator=gen).tolist()  # shared prefix
    out = [system + torch.randint(0, 128, (n,), generator=gen).tolist() for n in (3, 9, 1, 20)]
    out += [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 16, 2)]
    return out


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """The llama checkpoint and transformers' greedy continuation of every prompt."""
    path = tmp_path_factory.mktemp("llama")
    hf = build_hf_model("llama", path)
    return path, [hf_greedy(hf, p, MAX_TOKENS) for p in PROMPTS]


def run_engine(
    engine: LLMEngine,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams = GREEDY,
    *,
    stagger: bool = True,
) -> list[list[list[int]]]:
    """Run prompts to completion (one new request per step when staggered, so later ones can
    hit the cache); returns, per prompt, the token ids of each of its samples."""
    pending = list(enumerate(prompts))
    done: dict[str, list[list[int]]] = {}
    if not stagger:
        for i, p in pending:
            engine.add_request(f"r{i}", p, params)
        pending = []
    while pending or engine.has_unfinished_requests():
        if pending:
            i, p = pending.pop(0)
            engine.add_request(f"r{i}", p, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [list(c.token_ids) for c in out.outputs]
        engine.check_invariants()
    return [done[f"r{i}"] for i in range(len(prompts))]


def make_engine(path: Path, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(**{"block_size": 16, "num_blocks": 256, "check_invariants": True, **kw})
    return LLMEngine(load_model(path), None, cfg)


def test_greedy_matches_transformers_generate(checkpoint: tuple[Path, list[list[int]]]) -> None:
    path, refs = checkpoint
    got = run_engine(make_engine(path), PROMPTS, stagger=False)  # one mixed-length batch
    assert [g[0] for g in got] == refs


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_on_and_off(checkpoint: tuple[Path, list[list[int]]], caching: bool) -> None:
    path, refs = checkpoint
    engine = make_engine(path, block_size=4, enable_prefix_caching=caching)
    assert [g[0] for g in run_engine(engine, PROMPTS)] == refs
    hit_rate = engine.scheduler.stats().prefix_hit_rate
    assert (hit_rate > 0.2) if caching else (hit_rate == 0.0)


@pytest.mark.parametrize("chunk", [1, 7, 16])
def test_chunked_prefill_at_several_chunk_sizes(
    checkpoint: tuple[Path, list[list[int]]], chunk: int
) -> None:
    path, refs = checkpoint
    engine = make_engine(path, max_num_batched_tokens=chunk, max_num_seqs=min(4, chunk))
    assert [g[0] for g in run_engine(engine, PROMPTS)] == refs


@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_block_sizes(checkpoint: tuple[Path, list[list[int]]], block_size: int) -> None:
    path, refs = checkpoint
    engine = make_engine(path, block_size=block_size, num_blocks=4096 // block_size)
    assert [g[0] for g in run_engine(engine, PROMPTS)] == refs


def test_forced_preemption_and_recompute(checkpoint: tuple[Path, list[list[int]]]) -> None:
    path, refs = checkpoint
    # 19 usable blocks of 4 tokens (the longest request needs 17), admission on the prompt
    # alone: decodes run out of blocks and preempt
    engine = make_engine(
        path, block_size=4, num_blocks=20, reservation="none", watermark=0.0, max_num_seqs=8
    )
    assert [g[0] for g in run_engine(engine, PROMPTS, stagger=False)] == refs
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kernel", ["torch", "native"])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_both_decode_kernels_give_the_same_tokens(
    checkpoint: tuple[Path, list[list[int]]], block_size: int, kernel: str
) -> None:
    """Torch's batched decode path and the C kernel (the default where it builds), with prefix
    caching on (staggered requests hit the cache) and block sizes that do and do not divide
    the prompts."""
    from pagedkv.engine import native

    if kernel == "native" and not native.available():
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    path, refs = checkpoint
    engine = make_engine(
        path, block_size=block_size, num_blocks=4096 // block_size, decode_kernel=kernel
    )
    assert engine.runner.uses_native_decode() == (kernel == "native")
    assert [g[0] for g in run_engine(engine, PROMPTS)] == refs
    assert [g[0] for g in run_engine(engine, PROMPTS, stagger=False)] == refs


def test_native_decode_kernel_under_preemption(checkpoint: tuple[Path, list[list[int]]]) -> None:
    from pagedkv.engine import native

    if not native.available():
        pytest.skip(f"native kernel unavailable: {native.unavailable_reason()}")
    path, refs = checkpoint
    engine = make_engine(
        path,
        block_size=4,
        num_blocks=20,
        reservation="none",
        watermark=0.0,
        max_num_seqs=8,
        decode_kernel="native",
    )
    assert [g[0] for g in run_engine(engine, PROMPTS, stagger=False)] == refs
    assert engine.scheduler.num_preemptions > 0


def test_batched_decode_path_off_gives_the_same_tokens(
    checkpoint: tuple[Path, list[list[int]]],
) -> None:
    path, refs = checkpoint
    engine = make_engine(path, batched_decode=False)
    assert [g[0] for g in run_engine(engine, PROMPTS, stagger=False)] == refs


@pytest.mark.parametrize("block_size", [4, 16])
def test_n_samples_fork_and_share_prompt_blocks(
    checkpoint: tuple[Path, list[list[int]]], block_size: int
) -> None:
    path, refs = checkpoint
    engine = make_engine(path, block_size=block_size)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=3)
    got = run_engine(engine, PROMPTS[:5], params)
    for samples, ref in zip(got, refs, strict=False):
        assert samples == [ref, ref, ref]
    # every prompt whose last position sits inside a block forced a copy-on-write copy
    expected = sum(2 for p in PROMPTS[:5] if (len(p) - 1) % block_size)
    assert engine.scheduler.manager.num_cow_copies == expected


class OracleProposer:
    """Drafts that are right for a while, then wrong: exercises acceptance and rollback."""

    def __init__(self, prompts: list[list[int]], refs: list[list[int]]) -> None:
        self.full = [p + r for p, r in zip(prompts, refs, strict=True)]
        self.calls = 0

    def propose(self, token_ids: Sequence[int], limit: int | None = None) -> list[int]:
        self.calls += 1
        k = min(3, limit if limit is not None else 3)
        for seq in self.full:
            if seq[: len(token_ids)] == list(token_ids):
                good = seq[len(token_ids) : len(token_ids) + k]
                if self.calls % 3 == 0 and good:  # one wrong draft in three
                    good[-1] = (good[-1] + 1) % 128
                return good
        return []


def test_speculative_decoding_matches_plain(checkpoint: tuple[Path, list[list[int]]]) -> None:
    path, refs = checkpoint
    engine = make_engine(path, block_size=4, num_speculative_tokens=3)
    engine.proposer = OracleProposer(PROMPTS, refs)
    assert [g[0] for g in run_engine(engine, PROMPTS, stagger=False)] == refs
    assert engine.num_accepted_draft_tokens > 0
    assert engine.num_accepted_draft_tokens < engine.num_draft_tokens  # some were rolled back


@pytest.mark.parametrize("logprobs", [None, 2])
def test_speculation_keeps_seeded_samples(
    checkpoint: tuple[Path, list[list[int]]], logprobs: int | None
) -> None:
    """Seeded sampling draws the same tokens with drafts as without: the sampler stops at a
    rejected draft, so each generator advances once per kept token (batch_sampler)."""
    path, _ = checkpoint
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.7, seed=11, ignore_eos=True, logprobs=logprobs
    )
    plain = make_engine(path, block_size=4)
    want = [g[0] for g in run_engine(plain, PROMPTS, params, stagger=False)]
    engine = make_engine(path, block_size=4, num_speculative_tokens=3)
    engine.proposer = OracleProposer(PROMPTS, want)  # right drafts, one wrong in three
    assert [g[0] for g in run_engine(engine, PROMPTS, params, stagger=False)] == want
    assert 0 < engine.num_accepted_draft_tokens < engine.num_draft_tokens


def test_prompt_lookup_speculation_matches_plain(
    checkpoint: tuple[Path, list[list[int]]],
) -> None:
    path, refs = checkpoint
    engine = make_engine(path, num_speculative_tokens=4)
    assert [g[0] for g in run_engine(engine, PROMPTS, stagger=False)] == refs
    assert engine.num_accepted_draft_tokens > 0  # greedy loops repeat: lookup finds them


def test_forks_under_preemption(checkpoint: tuple[Path, list[list[int]]]) -> None:
    path, refs = checkpoint
    engine = make_engine(
        path, block_size=4, num_blocks=24, reservation="none", watermark=0.0, max_num_seqs=8
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=2)
    got = run_engine(engine, PROMPTS, params, stagger=False)
    assert got == [[r, r] for r in refs]
    assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize(
    ("dtype", "precision"),
    [("float32", "highest"), ("bfloat16", "highest"), ("bfloat16", "medium")],
)
def test_a_chat_turn_served_from_its_previous_answer_keeps_its_tokens(
    checkpoint: tuple[Path, list[list[int]]], dtype: str, precision: str
) -> None:
    """A chat's next turn sends the previous answer back: with caching on, the answer's full
    blocks (their K/V computed by decode steps) serve it; with caching off the same tokens
    are computed as prompt rows. The greedy tokens of the turn are the same either way."""
    from pagedkv.engine import bf16_dot

    if precision == "medium" and not bf16_dot.amx():
        pytest.skip("matmul_precision='medium' needs AMX")
    path, refs = checkpoint
    first = PROMPTS[0]
    second = first + refs[0] + [5, 6, 7]  # the turn: history, the answer, a new message
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)

    def turns(caching: bool) -> tuple[list[int], int]:
        cfg = EngineConfig(block_size=4, num_blocks=256, dtype=dtype, check_invariants=True,
                           matmul_precision=precision, enable_prefix_caching=caching)  # fmt: skip
        engine = LLMEngine.from_model_dir(str(path), cfg)
        run_engine(engine, [first], params)
        engine.add_request("turn2", second, params)
        got: tuple[list[int], int] = ([], -1)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got = (list(out.outputs[0].token_ids), out.num_cached_tokens)
        return got

    (cached, hits), (uncached, none) = turns(True), turns(False)
    assert none == 0
    assert hits >= len(first) + len(refs[0]) - 4  # the answer's full blocks hit too
    assert cached == uncached


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_speculation_keeps_every_bit_in_a_bf16_engine(tmp_path: Path, precision: str) -> None:
    """A bf16 engine (its linears batch invariant) verifying drafts computes each verified
    row as plain decoding would (a decode row of its own: ``attention_metadata``), so tokens
    and log-probabilities, seeded samples included, are plain decoding's bit for bit. (The
    verifying rows once took the prompt kernels: log-probabilities differed in the last
    bits, about 1e-3 under medium, and a seeded sample could change.)"""
    from pagedkv.engine.tiny import write_tiny_model

    _needs_row_invariant_prompts(precision)
    path = write_tiny_model(  # head_dim 32: the AMX prompt kernel's shape under medium
        tmp_path / "m", hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=None,
    )  # fmt: skip

    def run(temperature: float, oracle: list[list[int]] | None) -> tuple[list[Any], LLMEngine]:
        cfg = EngineConfig(block_size=4, num_blocks=256, dtype="bfloat16", check_invariants=True,
                           matmul_precision=precision,
                           num_speculative_tokens=3 if oracle else 0)  # fmt: skip
        engine = LLMEngine.from_model_dir(str(path), cfg)
        if oracle is not None:  # right drafts, one wrong in three
            engine.proposer = OracleProposer(PROMPTS, oracle)
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=5,
                                ignore_eos=True, logprobs=2)  # fmt: skip
        for i, p in enumerate(PROMPTS):
            engine.add_request(f"r{i}", p, params)
        got, _ = drain(engine)
        return [got[f"r{i}"] for i in range(len(PROMPTS))], engine

    for temperature in (0.0, 0.8):
        plain, _ = run(temperature, None)
        spec, engine = run(temperature, [[t for t, _ in row] for row in plain])
        assert 0 < engine.num_accepted_draft_tokens < engine.num_draft_tokens
        assert spec == plain


@pytest.mark.parametrize("precision", ["highest", "medium"])
def test_preemption_keeps_every_bit_in_a_bf16_engine(tmp_path: Path, precision: str) -> None:
    """Six requests in a pool too small for them: some are preempted and recompute. A resumed
    request's prompt is recomputed as prompt rows and its generated positions as decode rows
    (``ScheduledRequest.decode_from``), as they were computed before, so every token and
    log-probability is the unpressured run's bit for bit. (Recomputed outputs as prompt rows
    changed log-probabilities in the last bits.)"""
    from pagedkv.engine.tiny import write_tiny_model

    _needs_row_invariant_prompts(precision)
    path = write_tiny_model(
        tmp_path / "m", seed=3, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, eos_token_id=None,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 60, (n,), generator=gen).tolist() for n in (20, 30, 25, 40, 35, 22)]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=1)

    def run(**kw: Any) -> tuple[dict[str, list[tuple[int, float]]], int]:
        cfg = EngineConfig(block_size=4, dtype="bfloat16", matmul_precision=precision,
                           enable_prefix_caching=False, check_invariants=True, **kw)  # fmt: skip
        engine = LLMEngine.from_model_dir(str(path), cfg)
        for i, p in enumerate(prompts):
            engine.add_request(f"r{i}", p, params)
        return drain(engine)[0], engine.scheduler.num_preemptions

    free, none = run(num_blocks=512)
    tight, preempted = run(num_blocks=40, reservation="none", watermark=0.0, max_num_seqs=8)
    assert none == 0
    assert preempted > 0
    assert tight == free


def _needs_row_invariant_prompts(precision: str) -> None:
    """Skip where a bf16 engine's prompt rows are not row-invariant (no native prompt kernel:
    torch's SDPA then changes a row's bits with the chunk it is in)."""
    from pagedkv.engine import bf16_dot, prompt_attention

    if precision == "medium" and not (bf16_dot.amx() and prompt_attention.available()):
        pytest.skip("matmul_precision='medium' with its prompt kernel needs AMX")
    if not prompt_attention.available_f32():
        pytest.skip("the float32 prompt kernel needs AVX-512")


@pytest.mark.parametrize("head_dim", [32, 64])
def test_a_chat_turn_keeps_every_bit_under_medium(tmp_path: Path, head_dim: int) -> None:
    """Under ``medium`` decode rows compute with the bf16 prompt kernel's arithmetic
    (``pagedkv_decode_amx``), so the K/V of an answer's blocks are the bits the next turn's
    prompt would compute for the same tokens: the turn served from them gives the uncached
    run's tokens and log-probabilities bit for bit. (With the float32 decode kernel the
    log-probabilities moved by ~1e-3.)"""
    from pagedkv.engine.tiny import write_tiny_model

    _needs_row_invariant_prompts("medium")
    path = write_tiny_model(
        tmp_path / "m", seed=5, hidden_size=4 * head_dim, intermediate_size=192,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, eos_token_id=None,
        head_dim=head_dim,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    first = torch.randint(2, 60, (40,), generator=gen).tolist()
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, logprobs=1)

    def turns(caching: bool) -> tuple[list[tuple[int, float]], int]:
        cfg = EngineConfig(block_size=16, num_blocks=256, dtype="bfloat16",
                           matmul_precision="medium", enable_prefix_caching=caching)  # fmt: skip
        engine = LLMEngine.from_model_dir(str(path), cfg)
        engine.add_request("turn1", first, params)
        answer = [t for t, _ in drain(engine)[0]["turn1"]]
        engine.add_request("turn2", first + answer + [5, 6, 7], params)
        got, hits = drain(engine)
        return got["turn2"], hits

    (cached, hits), (uncached, none) = turns(True), turns(False)
    assert none == 0
    assert hits >= 80  # the prompt's and the answer's full blocks
    assert cached == uncached
