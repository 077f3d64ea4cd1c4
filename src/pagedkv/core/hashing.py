"""Chained block hashes: the names under which full blocks are shared.

``h[i] = H(h[i-1] || tokens of block i || extra keys of block i)`` and ``h[-1]`` is a root seeded by
the model id, the request's cache salt and the hash algorithm, so two tenants (different salts) or
two models never share a block, and a block hash names its whole prefix, not just its own tokens.

Encoding (stable across processes, platforms and Python versions, so hashes can name files on disk
and be shared between engines):

* tokens are packed as little-endian unsigned 32-bit integers (never text, never ``repr``);
  a token id outside ``[0, 2**32)`` is rejected;
* extra keys are encoded by :func:`encode_key`: a type tag, a length and the bytes, so ``1`` and
  ``"1"`` and ``b"1"`` differ, and nested tuples are unambiguous.

Which function to pick:

* ``xxh3_128`` (default): ~10x faster than sha256, 128 bits, not cryptographic. Right for one
  operator's traffic: an accidental collision among 2**64 blocks is negligible.
* ``sha256``: pick it when untrusted tenants choose prompts and share one cache (or one Redis
  tier). With a non-cryptographic hash an attacker can craft a prompt whose block hash collides
  with another tenant's, and be served that tenant's KV (wrong output, or a leak of its content).
  Cache salts per tenant also close that door, since tenants then never share a chain.

Hashes are computed once per request and extended incrementally as tokens arrive
(:class:`BlockHashChain`).
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import numpy as np
import xxhash

from pagedkv.errors import InvalidRequestError

BlockHash = bytes
"""A block hash: 16 bytes for xxh3-128, 32 bytes for sha256."""

ExtraKey = int | str | bytes | tuple["ExtraKey", ...]
"""What a block may carry besides its tokens: adapter ids, multimodal hashes, range keys."""

_ROOT_DOMAIN = b"pagedkv/block-hash/v1"
_MAX_TOKEN_ID = 2**32


class HashAlgo(Enum):
    """The hash function behind block hashes."""

    XXH3_128 = "xxh3_128"
    SHA256 = "sha256"


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


_HASH_FNS: dict[HashAlgo, Callable[[bytes], bytes]] = {
    HashAlgo.XXH3_128: xxhash.xxh3_128_digest,
    HashAlgo.SHA256: _sha256,
}


def hash_function(algo: HashAlgo | str) -> Callable[[bytes], bytes]:
    """Return the digest function for ``algo`` (an enum member or its value)."""
    try:
        return _HASH_FNS[HashAlgo(algo)]
    except ValueError:
        names = ", ".join(a.value for a in HashAlgo)
        raise InvalidRequestError(
            f"unknown hash algorithm {algo!r}; choose one of {names}"
        ) from None


def encode_key(key: ExtraKey) -> bytes:
    """Encode an extra key as tagged, length-prefixed bytes (deterministic, unambiguous)."""
    if isinstance(key, bool):
        raise InvalidRequestError("extra keys must be int, str, bytes or tuples of them, not bool")
    if isinstance(key, int):
        return b"i" + key.to_bytes(16, "little", signed=True)
    if isinstance(key, str):
        raw = key.encode("utf-8")
        return b"s" + struct.pack("<I", len(raw)) + raw
    if isinstance(key, bytes):
        return b"b" + struct.pack("<I", len(key)) + key
    if isinstance(key, tuple):
        return b"t" + struct.pack("<I", len(key)) + b"".join(encode_key(k) for k in key)
    raise InvalidRequestError(
        f"extra key {key!r} has type {type(key).__name__}; use int, str, bytes or a tuple of them"
    )


_FAST_U32 = array("I").itemsize == 4  # C unsigned int is 32 bits on every platform we know


def pack_tokens(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Pack token ids as little-endian uint32 bytes; raise on ids outside ``[0, 2**32)``."""
    if _FAST_U32 and isinstance(token_ids, list) and token_ids and type(token_ids[0]) is not bool:
        # Fast path for the common input, a list of ints: ``array`` converts and range-checks
        # in C, ~4x faster than ``np.asarray`` (which first scans for a dtype). Anything it
        # rejects (a negative or too large id, a float, a str) takes the numpy path below,
        # which raises the typed error. A leading bool also takes it, so an all-bool list is
        # still rejected as before.
        try:
            packed = array("I", token_ids)
        except (OverflowError, TypeError):
            pass
        else:
            if sys.byteorder != "little":  # pragma: no cover - big-endian hosts
                packed.byteswap()
            return packed.tobytes()
    arr = np.asarray(token_ids)
    if arr.size == 0:
        return b""
    if arr.dtype.kind not in "iu":
        raise InvalidRequestError(f"token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= _MAX_TOKEN_ID:
        bad = lo if lo < 0 else hi
        raise InvalidRequestError(f"token id {bad} is outside [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


@dataclass(frozen=True, slots=True)
class MultiModalItem:
    """A multimodal input (an image, say) occupying ``length`` placeholder tokens at ``offset``.

    Every block that overlaps the item carries ``(item_hash, offset - block_start)``, so two
    prompts with the same placeholder tokens but different images never share those blocks.
    """

    item_hash: bytes | str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length <= 0:
            raise InvalidRequestError(
                f"multimodal item needs offset >= 0 and length > 0, got offset={self.offset} "
                f"length={self.length}"
            )


@dataclass(frozen=True, slots=True)
class RangeKey:
    """A key that applies to token positions ``[start, end)`` (e.g. one image turn of a prompt)."""

    start: int
    end: int
    key: ExtraKey

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.end:
            raise InvalidRequestError(
                f"range key needs 0 <= start < end, got start={self.start} end={self.end}"
            )


@dataclass(frozen=True, slots=True)
class HashContext:
    """Everything besides token ids that decides a request's block hashes.

    ``model_id`` and ``cache_salt`` seed the root; ``adapter_id`` (a LoRA name, say) is carried by
    every block; ``mm_items`` and ``range_keys`` by the blocks they overlap.
    """

    model_id: str = ""
    cache_salt: str | None = None
    algo: HashAlgo = HashAlgo.XXH3_128
    adapter_id: str | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    range_keys: tuple[RangeKey, ...] = field(default=())

    def root_hash(self) -> BlockHash:
        """The chain's seed ``h[-1]``: model id, salt and algorithm, so none of them mix."""
        salt = b"" if self.cache_salt is None else b"\x01" + self.cache_salt.encode("utf-8")
        seed = _ROOT_DOMAIN + encode_key((self.algo.value, self.model_id)) + encode_key(salt)
        return hash_function(self.algo)(seed)

    @property
    def has_block_keys(self) -> bool:
        """Whether any block carries extra keys (otherwise hashing skips the per-block lookup)."""
        return self.adapter_id is not None or bool(self.mm_items) or bool(self.range_keys)

    def block_extra_keys(self, start: int, end: int) -> bytes:
        """Encoded extra keys of the block covering token positions ``[start, end)``."""
        keys: list[ExtraKey] = []
        if self.adapter_id is not None:
            keys.append(("adapter", self.adapter_id))
        keys.extend(
            ("mm", item.item_hash, item.offset - start)
            for item in self.mm_items
            if item.offset < end and item.offset + item.length > start
        )
        keys.extend(
            ("range", rk.key) for rk in self.range_keys if rk.start < end and rk.end > start
        )
        return encode_key(tuple(keys)) if keys else b""


class BlockHashChain:
    """The block hashes of one token sequence, extended incrementally as tokens arrive.

    Invariants:
      H1  len(hashes) == len(token_ids) // block_size (only full blocks are hashed)
      H2  hashes[i] == H(hashes[i-1] || pack(tokens of block i) || extra keys of block i)
    Complexity: ``extend`` costs O(new tokens); nothing is ever rehashed.

    ``tail`` (the token ids after the last full block, fewer than ``block_size``) may be
    appended to directly by the manager's batched decode commit, one valid id at a time and
    only while ``len(tail) + 1 < block_size`` (no block completes, so H1 and H2 still hold):
    ``try_append`` without its call. Anything else goes through the methods.
    """

    __slots__ = ("_ctx", "_fn", "_hashes", "_root", "_tokens_hashed", "block_size", "tail")

    def __init__(self, block_size: int, context: HashContext | None = None) -> None:
        if block_size <= 0:
            raise InvalidRequestError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._ctx = context or HashContext()
        self._fn = hash_function(self._ctx.algo)
        self._root = self._ctx.root_hash()
        self._hashes: list[BlockHash] = []
        self.tail: list[int] = []  # tokens after the last full block (< block_size of them)
        self._tokens_hashed = 0

    @property
    def hashes(self) -> list[BlockHash]:
        """The hashes of the full blocks so far (do not mutate)."""
        return self._hashes

    @property
    def root(self) -> BlockHash:
        return self._root

    @property
    def context(self) -> HashContext:
        return self._ctx

    def parent_of(self, index: int) -> BlockHash:
        """The hash before block ``index`` (the root for block 0)."""
        return self._root if index == 0 else self._hashes[index - 1]

    def try_append(self, token_id: int) -> bool:
        """Append one valid token id that completes no block (the decode hot path, with no
        list built); False, changing nothing, for anything else (then call ``extend``)."""
        pending = self.tail
        if (
            len(pending) + 1 < self.block_size
            and type(token_id) is int
            and 0 <= token_id < _MAX_TOKEN_ID
        ):
            pending.append(token_id)
            return True
        return False

    def try_complete(self, token_id: int) -> BlockHash | None:
        """Append one valid token id that completes a block with no per-block keys (the decode
        that fills its block) and return that block's hash: exactly ``extend([token_id])[0]``
        (the same bytes hashed: the parent, then the block's ids as little-endian uint32), with
        no list packed apart. None, changing nothing, for anything else (then call ``extend``)."""
        pending = self.tail
        if (
            len(pending) + 1 != self.block_size
            or type(token_id) is not int
            or not 0 <= token_id < _MAX_TOKEN_ID
            or not _FAST_U32
            or sys.byteorder != "little"
            or self._ctx.has_block_keys
        ):
            return None
        try:
            packed = array("I", pending)
        except (OverflowError, TypeError):  # pragma: no cover - pending ids are validated
            return None
        packed.append(token_id)
        hashes = self._hashes
        h = self._fn((hashes[-1] if hashes else self._root) + packed.tobytes())
        hashes.append(h)
        self.tail = []
        self._tokens_hashed += self.block_size
        return h

    def extend(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Append tokens and return the hashes of the blocks they completed (maybe none)."""
        bs = self.block_size
        if len(token_ids) == 1 and len(self.tail) + 1 < bs:
            t = token_ids[0]  # the decode fast path: one token that completes no block
            if type(t) is int and 0 <= t < _MAX_TOKEN_ID:
                self.tail.append(t)
                return []
        # No copy of a long token list: the input is packed once (which also validates every
        # id), the pending tail is packed apart and prepended as bytes, and blocks are hashed
        # from slices of the packed bytes. Only the new tail (< block_size ids) is kept as ints.
        pending = self.tail
        num_full = (len(pending) + len(token_ids)) // bs
        if num_full == 0:
            if token_ids:
                pack_tokens(token_ids)  # validate even when no block completes yet
            self.tail = [*pending, *token_ids]
            return []
        packed = pack_tokens(token_ids)
        if pending:
            packed = pack_tokens(pending) + packed
        width = bs * 4
        fn = self._fn
        ctx = self._ctx
        parent = self._hashes[-1] if self._hashes else self._root
        start = self._tokens_hashed
        new: list[BlockHash] = []
        if ctx.has_block_keys:
            for i in range(num_full):
                block_start = start + i * bs
                chunk = packed[i * width : (i + 1) * width]
                chunk += ctx.block_extra_keys(block_start, block_start + bs)
                parent = fn(parent + chunk)
                new.append(parent)
        else:  # the hot path: no per-block keys, one slice and one digest per block
            append = new.append
            for offset in range(0, num_full * width, width):
                parent = fn(parent + packed[offset : offset + width])
                append(parent)
        rest = list(token_ids[num_full * bs - len(pending) :])
        self.tail = rest
        self._hashes.extend(new)
        self._tokens_hashed += num_full * bs
        return new

    def preview(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """The hashes ``extend(token_ids)`` would return, changing nothing. O(new tokens): the
        chain's hash list is not copied (only its last hash is needed as the parent)."""
        clone = BlockHashChain.__new__(BlockHashChain)
        clone.block_size = self.block_size
        clone._ctx = self._ctx
        clone._fn = self._fn
        clone._root = self._root
        clone._hashes = self._hashes[-1:]
        clone.tail = list(self.tail)
        clone._tokens_hashed = self._tokens_hashed
        return clone.extend(token_ids)

    def copy(self) -> BlockHashChain:
        """An independent chain with the same state (for forks)."""
        clone = BlockHashChain.__new__(BlockHashChain)
        clone.block_size = self.block_size
        clone._ctx = self._ctx
        clone._fn = self._fn
        clone._root = self._root
        clone._hashes = list(self._hashes)
        clone.tail = list(self.tail)
        clone._tokens_hashed = self._tokens_hashed
        return clone


def hash_blocks(
    token_ids: Sequence[int], block_size: int, context: HashContext | None = None
) -> list[BlockHash]:
    """The chained hashes of every full block of ``token_ids`` (a convenience for one-off use)."""
    chain = BlockHashChain(block_size, context)
    chain.extend(token_ids)
    return chain.hashes
