"""vLLM v1's KV cache manager, block pool and block hashing on pagedkv's fixtures.

``--peer-vllm PATH``: PATH holds ``vllm/v1/core/*.py`` (unzip the wheel from
``pip download --no-deps vllm`` there). Its modules are loaded from PATH; the rest of the vLLM
package is replaced by the stand-ins in ``vllm_shims.py``. One KV cache group (full attention,
block size 16), prefix caching on, events and stats off: vLLM's defaults for a plain decoder.

The fixtures mirror bench_core's, through vLLM's public manager API (what its scheduler calls):

prefix  ``get_computed_blocks(req)`` + ``allocate_slots(req, n, hit, blocks)`` of a prompt whose
        blocks a finished request cached; the request's block hashes are computed untimed
        (vLLM hashes on ``Request`` creation); ``free(req)`` untimed.
alloc   ``BlockPool.get_new_blocks(n)`` + ``free_blocks`` of the same blocks, per block.
hash    vLLM's request block hasher (``hash_block_tokens`` chained, pickle + digest) over the
        same 32K-token prompt, per block: ``xxhash`` against pagedkv's xxh3_128, ``sha256``
        against pagedkv's sha256.
"""

from __future__ import annotations

import importlib
import logging
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _harness import Case
from peers._loader import PeerImporter, install
from peers.vllm_shims import REAL, SHIMS

BLOCK_SIZE = 16


class _Request:
    """What vLLM's KV cache manager reads of a request (its own ``Request`` needs the engine)."""

    def __init__(self, request_id: str, token_ids: list[int], status: Any) -> None:
        self.request_id = request_id
        self.all_token_ids = list(token_ids)
        self.prompt_token_ids = self.all_token_ids
        self._all_token_ids = self.all_token_ids  # vLLM 0.34's hasher reads the private name
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.num_in_flight_tokens = 0
        self.num_preemptions = 0
        self.status = status
        self.block_hashes: list[bytes] = []
        self.mm_features: list[Any] = []
        self.lora_request = None
        self.cache_salt = None
        self.prompt_embeds = None
        self.skip_reading_prefix_cache = False
        self.session_id = None
        self.shared_prefix_boundary = 0
        self.prefix_cache_hit_limit: int | None = None  # vLLM 0.34: unbounded (no prompt logprobs)
        self._prompt_embeds_per_block_hashes = None  # vLLM 0.34's hasher (no prompt embeds)

    def get_max_cache_hit_length(self, bound: int | None = None) -> int:
        """vLLM 0.34's ``Request.get_max_cache_hit_length`` (the last token is recomputed)."""
        limit = self.num_tokens - 1
        return limit if bound is None else min(limit, bound)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class VLLMPeer:
    """vLLM's modules loaded from a tree, and its cases for bench_core's fixtures."""

    def __init__(self, mods: dict[str, types.ModuleType]) -> None:
        self.mods = mods

    def cases(self, fixture: str, quick: bool) -> list[Case]:
        builders = {
            "prefix": self.prefix_cases,
            "alloc": self.alloc_cases,
            "hash": self.hash_cases,
            "free": self.free_cases,
            "touch": self.touch_cases,
            "counts": self.count_cases,
            "evict": lambda q: self.evict_cases(q) + self.evict_copy_cases(q),
        }
        return builders[fixture](quick) if fixture in builders else []

    def _manager(self, num_blocks: int, max_model_len: int) -> Any:
        import torch

        iface = self.mods["iface"]
        spec = iface.FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=8, head_size=128, dtype=torch.float16
        )
        group = iface.KVCacheGroupSpec(layer_names=["layer.0"], kv_cache_spec=spec)
        config = iface.KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[group]
        )
        return self.mods["manager"].KVCacheManager(
            config,
            max_model_len=max_model_len,
            scheduler_block_size=BLOCK_SIZE,
            hash_block_size=BLOCK_SIZE,
            enable_caching=True,
        )

    def prefix_cases(self, quick: bool) -> list[Case]:
        from bench_core import PREFIX_LENGTHS, prefix_prompt

        utils, hashing = self.mods["utils"], self.mods["hashing"]
        waiting = self.mods["request"].RequestStatus.WAITING
        hash_fn = hashing.sha256  # vLLM's default prefix-caching hash
        utils.init_none_hash(hash_fn)
        hasher = utils.get_request_block_hasher(BLOCK_SIZE, hash_fn)
        cases: list[Case] = []
        for num_tokens in PREFIX_LENGTHS[:1] if quick else PREFIX_LENGTHS:
            prompt = prefix_prompt(num_tokens)
            mgr = self._manager(2 * num_tokens // BLOCK_SIZE + 64, 2 * num_tokens)

            def new_request(rid: str, prompt: list[int] = prompt) -> _Request:
                req = _Request(rid, prompt, waiting)
                req.block_hashes.extend(hasher(req))  # vLLM hashes when a Request is built
                return req

            warm = new_request("warm")
            blocks, hit, _ = mgr.get_computed_blocks(warm)
            if mgr.allocate_slots(warm, num_tokens - hit, hit, blocks) is None:
                raise ValueError("vLLM could not allocate the warm-up request")
            warm.num_computed_tokens = num_tokens
            mgr.free(warm)  # every full block is now cached-free
            st: dict[str, Any] = {"n": 0}

            def setup(st: dict[str, Any] = st, new_request: Any = new_request) -> None:
                st["n"] += 1
                st["req"] = new_request(f"r{st['n']}")

            def op(st: dict[str, Any] = st, mgr: Any = mgr, n: int = num_tokens) -> None:
                req = st["req"]
                blocks, hit, _ = mgr.get_computed_blocks(req)
                st["out"] = mgr.allocate_slots(req, n - hit, hit, blocks)
                st["hit"] = hit

            def check(st: dict[str, Any] = st, n: int = num_tokens) -> None:
                if st["out"] is None or st["hit"] != (n - 1) // BLOCK_SIZE * BLOCK_SIZE:
                    raise RuntimeError(f"vLLM prefix fixture hit {st['hit']} tokens, not all")

            cases.append(
                Case(
                    "prefix",
                    f"cached prompt={num_tokens:,} tokens",
                    "vllm",
                    "prompt",
                    op,
                    setup=setup,
                    teardown=lambda st=st, mgr=mgr: mgr.free(st["req"]),
                    rounds=5 if quick else 21,
                    warmup=2,
                    params={"prompt_tokens": num_tokens},
                    note="KVCacheManager",
                    check=check,
                )
            )
        return cases

    def free_cases(self, quick: bool) -> list[Case]:
        """``KVCacheManager.free`` of a finished request: cached, shared, copies (``vllm_free``)."""
        from bench_core import FREE_LENGTHS, prefix_prompt
        from core_free import FREE_KINDS
        from peers.vllm_free import free_case

        utils, hashing = self.mods["utils"], self.mods["hashing"]
        waiting = self.mods["request"].RequestStatus.WAITING
        hash_fn = hashing.sha256
        utils.init_none_hash(hash_fn)
        hasher = utils.get_request_block_hasher(BLOCK_SIZE, hash_fn)

        def new_request(rid: str, prompt: list[int]) -> _Request:
            req = _Request(rid, prompt, waiting)
            req.block_hashes.extend(hasher(req))
            return req

        return [
            free_case(kind, prefix_prompt(n), BLOCK_SIZE, quick, self._manager, new_request)
            for n in (FREE_LENGTHS[:1] if quick else FREE_LENGTHS)
            for kind in FREE_KINDS
        ]

    def touch_cases(self, quick: bool) -> list[Case]:
        """``BlockPool.touch`` of a cached prompt's blocks (``vllm_touch``)."""
        from bench_core import PREFIX_LENGTHS
        from core_touch import TOUCH_KINDS
        from peers.vllm_touch import touch_case

        waiting = self.mods["request"].RequestStatus.WAITING

        def new_request(rid: str, num_blocks: int) -> _Request:
            req = _Request(rid, [0] * (num_blocks * BLOCK_SIZE), waiting)
            req.block_hashes.extend(i.to_bytes(32, "little") for i in range(num_blocks))
            return req

        pool_class = self.mods["pool"].BlockPool
        return [
            touch_case(kind, n, BLOCK_SIZE, quick, pool_class, new_request)
            for n in (PREFIX_LENGTHS[:1] if quick else PREFIX_LENGTHS)
            for kind in TOUCH_KINDS
        ]

    def evict_cases(self, quick: bool) -> list[Case]:
        """``BlockPool.get_new_blocks(64)`` when every free block is cached (each is evicted);
        re-cached through ``cache_full_blocks`` and freed untimed between calls."""
        waiting = self.mods["request"].RequestStatus.WAITING
        cases: list[Case] = []
        for num_blocks in (1024,) if quick else (1024, 16_384, 131_072):
            pool = self.mods["pool"].BlockPool(num_blocks, True, BLOCK_SIZE)
            counter = [0]

            def cache_and_free(blocks: list[Any], pool: Any = pool, c: list[int] = counter) -> None:
                req = _Request(f"e{c[0]}", [0] * (len(blocks) * BLOCK_SIZE), waiting)
                req.block_hashes.extend(
                    (c[0] + i).to_bytes(32, "little") for i in range(len(blocks))
                )
                c[0] += len(blocks)
                pool.cache_full_blocks(req, blocks, 0, len(blocks), BLOCK_SIZE, 0)
                pool.free_blocks(reversed(blocks))

            cache_and_free(pool.get_new_blocks(pool.get_num_free_blocks()))

            def check(pool: Any = pool, n: int = num_blocks) -> None:
                cached = len(pool.cached_block_hash_to_block._cache)
                if cached != n - 1:  # every block but the null block holds a hash
                    raise RuntimeError(f"vLLM evict fixture: {cached} cached blocks of {n - 1}")

            cases.append(_evict_case("", pool, num_blocks, cache_and_free, check, quick))
        return cases

    def evict_copy_cases(self, quick: bool) -> list[Case]:
        """``get_new_blocks(64)`` when every free block duplicates a held block's hash (vLLM
        keeps both under the hash; each eviction pops the duplicate from its map)."""
        from bench_core import copy_hash

        waiting = self.mods["request"].RequestStatus.WAITING
        cases: list[Case] = []
        for num_blocks in (1024,) if quick else (1024, 16_384, 131_072):
            pool = self.mods["pool"].BlockPool(num_blocks, True, BLOCK_SIZE)
            half = (num_blocks - 1) // 2

            def cache(blocks: list[Any], pool: Any = pool, half: int = half) -> None:
                req = _Request("c", [0] * (len(blocks) * BLOCK_SIZE), waiting)
                req.block_hashes.extend(copy_hash(b.block_id, half) for b in blocks)
                pool.cache_full_blocks(req, blocks, 0, len(blocks), BLOCK_SIZE, 0)

            cache(pool.get_new_blocks(half))  # held for the whole run

            def copy_and_free(blocks: list[Any], pool: Any = pool, c: Any = cache) -> None:
                c(blocks)
                pool.free_blocks(reversed(blocks))

            copy_and_free(pool.get_new_blocks(pool.get_num_free_blocks()))

            def check(pool: Any = pool, half: int = half) -> None:
                dup = len(pool.cached_block_hash_to_block._cache)
                if dup != half:  # one key per held hash (each with its duplicate)
                    raise RuntimeError(f"vLLM evict fixture (copies): {dup} keys, not {half}")

            cases.append(_evict_case("copies", pool, num_blocks, copy_and_free, check, quick))
        return cases

    def count_cases(self, quick: bool) -> list[Case]:
        pool = self.mods["pool"].BlockPool(131_072, True, BLOCK_SIZE)
        pool.get_new_blocks(65_536)
        return [
            Case(
                "counts",
                f"pool.{ours}, pool=131,072",
                "vllm",
                "read",
                fn,
                calls_per_round=10_000,
                rounds=5 if quick else 11,
                params={"query": ours},
                note=theirs,
            )
            for ours, theirs, fn in (
                ("num_free_blocks", "get_num_free_blocks()", pool.get_num_free_blocks),
                ("usage", "get_usage()", pool.get_usage),
            )
        ]

    def alloc_cases(self, quick: bool) -> list[Case]:
        from bench_core import ALLOC_BATCHES, ALLOC_POOL_SIZES

        cases: list[Case] = []
        for num_blocks in sorted(ALLOC_POOL_SIZES[:2] if quick else ALLOC_POOL_SIZES):
            for batch in ALLOC_BATCHES:
                pool = self.mods["pool"].BlockPool(num_blocks, True, BLOCK_SIZE)

                def group(
                    get: Callable[..., Any] = pool.get_new_blocks,
                    free: Callable[..., Any] = pool.free_blocks,
                    batch: int = batch,
                ) -> None:
                    free(get(batch))

                cases.append(
                    Case(
                        "alloc+free",
                        f"pool={num_blocks:,} batch={batch}",
                        "vllm",
                        "block",
                        group,
                        ops=batch,
                        calls_per_round=max(1, 640 // batch),
                        params={"pool_blocks": num_blocks, "batch": batch},
                        note="BlockPool",
                    )
                )
        return cases

    def hash_cases(self, quick: bool) -> list[Case]:
        from bench_core import HASH_TOKENS, HASH_TOKENS_QUICK, prefix_prompt

        utils, hashing = self.mods["utils"], self.mods["hashing"]
        waiting = self.mods["request"].RequestStatus.WAITING
        num_tokens = HASH_TOKENS_QUICK if quick else HASH_TOKENS
        prompt = prefix_prompt(num_tokens, seed=2)
        cases: list[Case] = []
        for ours, theirs in (("xxh3_128", "xxhash"), ("sha256", "sha256")):
            hash_fn = hashing.get_hash_fn_by_name(theirs)
            hasher = utils.get_request_block_hasher(BLOCK_SIZE, hash_fn)
            reqs: list[_Request] = []

            def setup(reqs: list[_Request] = reqs, hash_fn: Any = hash_fn) -> None:
                utils.init_none_hash(hash_fn)  # the root hash belongs to the hash function
                reqs.append(_Request("h", prompt, waiting))

            cases.append(
                Case(
                    "hash",
                    f"{ours}, {num_tokens:,}-token prompt",
                    "vllm",
                    "block",
                    lambda reqs=reqs, hasher=hasher: reqs[-1].block_hashes.extend(hasher(reqs[-1])),
                    ops=num_tokens // BLOCK_SIZE,
                    setup=setup,
                    teardown=reqs.clear,
                    rounds=5 if quick else 11,
                    warmup=2,
                    params={"algo": theirs, "prompt_tokens": num_tokens},
                    note=f"{theirs} (pickle)",
                )
            )
        return cases


def load(path: str) -> VLLMPeer:
    """Load vLLM's KV cache modules from the tree at ``path`` (see the module docstring)."""
    tree = Path(path).expanduser().resolve()
    if not (tree / "vllm" / "v1" / "core" / "kv_cache_manager.py").is_file():
        raise OSError(f"{tree} has no vllm/v1/core/kv_cache_manager.py (extract the wheel there)")
    install(PeerImporter("vllm", tree, REAL, SHIMS))
    logging.getLogger("vllm").setLevel(logging.ERROR)  # xxhash's per-process seed warning
    names = {
        "manager": "vllm.v1.core.kv_cache_manager",
        "pool": "vllm.v1.core.block_pool",
        "utils": "vllm.v1.core.kv_cache_utils",
        "iface": "vllm.v1.kv_cache_interface",
        "hashing": "vllm.utils.hashing",
        "request": "vllm.v1.request",
    }
    return VLLMPeer({k: importlib.import_module(v) for k, v in names.items()})


def _evict_case(
    kind: str,
    pool: Any,
    num_blocks: int,
    refill: Callable[[list[Any]], None],
    check: Callable[[], None],
    quick: bool,
) -> Case:
    """A vLLM row of ``evict``: ``get_new_blocks(64)`` timed, ``refill`` of them untimed after
    (bench_core's ``_evict_case``, on vLLM's pool)."""
    batch = 64
    held: list[list[Any]] = []
    params: dict[str, Any] = {"pool_blocks": num_blocks, "batch": batch}
    return Case(
        "evict",
        f"{kind + ' ' if kind else ''}pool={num_blocks:,} batch={batch}",
        "vllm",
        "block",
        lambda: held.append(pool.get_new_blocks(batch)),
        ops=batch,
        teardown=lambda: refill(held.pop()),
        rounds=9 if quick else 41,
        warmup=3,
        params={**params, "kind": kind} if kind else params,
        note="BlockPool.get_new_blocks",
        check=check,
    )
