"""bench_core's ``free`` fixture: ``KVCacheManager.free`` of a finished request, three ways.

cached   the request hit every full block of a cached prompt (its last block recomputed, a copy);
         each block reaches ref 0 and goes back to the LRU (the usual free, the fast path)
shared   as ``cached`` while another live request holds the same blocks: every hit block goes
         from ref 2 to 1 and stays in use (the decrementing path, one shared count)
nested   as ``shared``, and a third live request holds the first half of the prompt: the hit
         blocks go from 3 to 2 or from 2 to 1 (the decrementing path with several counts)
copies   the request computed the whole prompt while another live request computed the same
         content (both allocated before either committed): every block is a copy of a hash
         indexed at the other request's block and goes to the front of the LRU, its copy
         entry kept until it is evicted (the copy path; vLLM keeps a freed duplicate under its
         hash in its free queue too)

Like for like with vLLM's fixture (``peers/vllm_free.py``): each request's token list is made in
the untimed set-up and stays with the fixture until the next set-up, as vLLM's ``Request`` keeps
``all_token_ids`` after ``KVCacheManager.free``. The request is added with
``adopt_token_ids=True``, as the scheduler adds it (its ``Request`` and the manager share one
list), so ``free`` drops the manager's references, not a private copy of 4K-32K tokens. The
request's block hashes are treated alike: vLLM's ``Request`` owns ``block_hashes`` and keeps
them past ``free`` (they go when the scheduler drops the request), so the set-up keeps the
list ``block_hashes(rid)`` returns (the manager's own) until the next round, and ``free`` drops
the manager's reference to it, not 256-2,048 hash objects. (Until this round's fixture the
hashes died inside pagedkv's ``free``: ~3-5 µs at 4K, ~12-25 µs at 32K.)
"""

from __future__ import annotations

from typing import Any

from _harness import Case
from pagedkv.core import CacheConfig, KVCacheManager

FREE_KINDS = ("cached", "shared", "nested", "copies")


def _admit(m: KVCacheManager, rid: str, tokens: list[int]) -> None:
    """Add, match, allocate and commit a whole prompt (the set-up of one round)."""
    m.add_request(rid, tokens, adopt_token_ids=True)
    hit = m.match_prefix(rid).num_cached_tokens
    m.allocate_slots(rid, len(tokens) - hit)
    m.commit(rid, len(tokens) - hit)


def _admit_copies(m: KVCacheManager, rid: str, holder: str, prompt: list[int]) -> list[list[int]]:
    """Two requests compute the same prompt, both allocated before either commits: ``rid``'s
    blocks become copies of ``holder``'s (nothing is cached beforehand). Returns their token
    lists (the caller keeps them past ``free``, as vLLM's ``Request`` keeps its tokens)."""
    n = len(prompt)
    token_lists = [list(prompt), list(prompt)]
    for r, tokens in zip((holder, rid), token_lists, strict=True):
        m.add_request(r, tokens, adopt_token_ids=True)
        if m.match_prefix(r).num_cached_tokens:
            raise RuntimeError("free fixture (copies): the prompt was cached beforehand")
        m.allocate_slots(r, n)
    m.commit(holder, n)
    m.commit(rid, n)
    return token_lists


def free_case(kind: str, prompt: list[int], block_size: int, quick: bool) -> Case:
    """The pagedkv case of one kind (see the module docstring)."""
    n = len(prompt)
    m = KVCacheManager(CacheConfig(block_size=block_size, num_blocks=3 * n // block_size + 64))
    st: dict[str, Any] = {"n": 0}
    if kind != "copies":
        _admit(m, "warm", list(prompt))
        m.free("warm")  # every full block is cached-free
    if kind in ("shared", "nested"):
        _admit(m, "holder", list(prompt))  # holds every block while the rounds run
    if kind == "nested":
        _admit(m, "half", prompt[: n // 2])  # and the first half of them

    def setup() -> None:
        st["n"] += 1
        rid = st["rid"] = f"f{st['n']}"
        if kind == "copies":
            st["tokens"] = _admit_copies(m, rid, f"h{st['n']}", prompt)
        else:
            st["tokens"] = list(prompt)  # kept past free, as vLLM's Request keeps its tokens
            _admit(m, rid, st["tokens"])
        st["hashes"] = m.block_hashes(rid)  # kept past free, as vLLM's Request keeps them
        if kind != "copies" and m.num_hit_tokens(rid) < n - block_size:
            raise RuntimeError(f"free fixture ({kind}): the request did not hit its prompt")

    def teardown() -> None:
        if kind == "copies":
            m.free(f"h{st['n']}")
            m.reset_prefix_cache()  # nothing cached: the next pair computes the prompt again

    def check() -> None:
        m.check_invariants()
        num_full = n // block_size
        # warm's last block; freed copies (a recomputed last block, waiting at the LRU's
        # front) are not counted; copies' teardown resets the cache
        want = {"cached": num_full, "shared": 1, "nested": 1, "copies": 0}[kind]
        if m.pool.num_cached_free_blocks != want:
            raise RuntimeError(f"free fixture ({kind}): {want} cached-free blocks expected")

    return Case(
        "free",
        f"{kind} prompt={n:,} tokens",
        "pagedkv",
        "prompt",
        lambda: m.free(st["rid"]),
        setup=setup,
        teardown=teardown,
        rounds=5 if quick else (201 if n <= 1024 else 61 if n <= 4096 else 21),
        warmup=2,
        params={"prompt_tokens": n, "kind": kind},
        check=check,
    )
