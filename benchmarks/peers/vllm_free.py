"""vLLM's side of bench_core's ``free`` fixture (``core_free.py``): ``KVCacheManager.free`` of
a finished request, three ways, through vLLM's public manager API.

cached   the request hit every full block of a cached prompt; every block reaches ref 0
shared   another live request holds the same blocks: every hit block goes from ref 2 to 1
nested   as ``shared``, and a third request holds the first half: from 3 to 2 or 2 to 1
copies   two requests allocated the prompt with ``delay_cache_blocks`` and then cached it, so the
         freed request's blocks duplicate the other's (vLLM keeps both under the hash, and puts
         the freed ones in the LRU like any cached block)

Each round's ``Request`` (its token list and block hashes) is built in the untimed set-up and
kept until the next one, as vLLM's scheduler keeps it past ``free``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from _harness import Case


def free_case(
    kind: str,
    prompt: list[int],
    block_size: int,
    quick: bool,
    manager: Callable[[int, int], Any],
    new_request: Callable[[str, list[int]], Any],
) -> Case:
    """vLLM's case of one kind; ``manager(num_blocks, max_model_len)`` builds its manager and
    ``new_request(rid, prompt)`` a hashed waiting request."""
    n = len(prompt)
    mgr = manager(3 * n // block_size + 64, 2 * n)
    st: dict[str, Any] = {"n": 0}

    def admit(rid: str, tokens: list[int] = prompt) -> Any:
        req = new_request(rid, tokens)
        blocks, hit, _ = mgr.get_computed_blocks(req)
        if mgr.allocate_slots(req, len(tokens) - hit, hit, blocks) is None:
            raise RuntimeError("vLLM could not allocate the free fixture's request")
        req.num_computed_tokens = len(tokens)
        st["hit"] = hit
        return req

    if kind != "copies":
        mgr.free(admit("warm"))
    if kind in ("shared", "nested"):
        st["holder"] = admit("holder")
    if kind == "nested":
        st["half"] = admit("half", prompt[: n // 2])

    def setup() -> None:
        st["n"] += 1
        if kind != "copies":
            st["req"] = admit(f"f{st['n']}")
            return
        pair = [new_request(f"{p}{st['n']}", prompt) for p in ("h", "f")]
        for req in pair:
            blocks, hit, _ = mgr.get_computed_blocks(req)
            if hit or mgr.allocate_slots(req, n, 0, blocks, delay_cache_blocks=True) is None:
                raise RuntimeError("vLLM free fixture (copies): the prompt was cached or full")
        for req in pair:
            mgr.cache_blocks(req, n)
            req.num_computed_tokens = n
        st["holder"], st["req"] = pair

    def teardown() -> None:
        if kind == "copies":
            mgr.free(st["holder"])
            if not mgr.reset_prefix_cache():
                raise RuntimeError("vLLM free fixture (copies): reset_prefix_cache refused")

    def check() -> None:
        if kind != "copies" and st["hit"] != (n - 1) // block_size * block_size:
            raise RuntimeError(f"vLLM free fixture hit {st['hit']} tokens, not all")

    return Case(
        "free",
        f"{kind} prompt={n:,} tokens",
        "vllm",
        "prompt",
        lambda: mgr.free(st["req"]),
        setup=setup,
        teardown=teardown,
        rounds=5 if quick else (201 if n <= 1024 else 61 if n <= 4096 else 21),
        warmup=2,
        params={"prompt_tokens": n, "kind": kind},
        note="KVCacheManager.free",
        check=check,
    )
