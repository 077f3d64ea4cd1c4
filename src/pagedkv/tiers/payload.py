"""Block payloads: one block's K and V for every layer, behind a self-describing header.

A payload is what every tier stores under a block hash. The header names everything a reader
needs to refuse a block that is not its own (format version, model id, layout, dtype, the block
hash itself) and a checksum over header and body, so a torn, truncated, bit-flipped, renamed or
foreign payload is *detected* and becomes a miss: never wrong KV, never a crash.

Wire format (little-endian; ``H`` = header length, which includes the variable fields)::

    offset  size  field
    0       4     magic  b"PKVB"
    4       2     format version (FORMAT_VERSION)
    6       2     header length H
    8       4     num_layers
    12      4     num_kv_heads
    16      4     head_dim
    20      4     block_size
    24      4     num_tokens          (<= block_size; full blocks carry block_size)
    28      4     reserved (0)
    32      8     body length          (== layout.block_bytes)
    40      8     checksum             xxh3-64 over header (this field zeroed) + body
    48      1     block hash length
    49      1     dtype name length
    50      2     model id length
    52      ...   block hash, dtype name (ascii), model id (utf-8)
    H       ...   body: K then V of every layer, ``read_block``'s layout
                  ([2 * num_layers, block_size, num_kv_heads, head_dim] of dtype)

Why xxh3-64: it checks a 2 MB body at tens of GB/s, so verification is never the bottleneck of a
disk or Redis read; it guards against accidents (torn writes, bit rot), not against an attacker
who can write to the tier (such a party could serve any KV anyway).
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import xxhash

from pagedkv.errors import CorruptBlockError, InvalidRequestError

FORMAT_VERSION = 1
MAGIC = b"PKVB"

_FIXED = struct.Struct("<4sHHIIIIIIQQBBH")
_CHECKSUM_OFFSET = 40
_MAX_HEADER_BYTES = 0xFFFF

DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
"""The dtypes a payload may carry, by the name torch and numpy give them, and their sizes."""


@dataclass(frozen=True, slots=True)
class TierLayout:
    """Which blocks a tier holds: one model's KV with one shape and dtype.

    ``namespace`` (format version + model id + layout) prefixes Redis keys and ``tag`` (a short
    digest of it) marks disk file names, so two models or two layouts never read each other's
    blocks even when they share a store.
    """

    model_id: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str = "float16"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, name)
            if not 0 < value < 2**32:
                raise InvalidRequestError(f"{name} must be in [1, 2**32), got {value}")
        if self.dtype not in DTYPE_ITEMSIZE:
            names = ", ".join(DTYPE_ITEMSIZE)
            raise InvalidRequestError(f"unsupported dtype {self.dtype!r}; use one of {names}")
        if len(self.model_id.encode("utf-8")) > 4096:
            raise InvalidRequestError("model_id is longer than 4096 bytes")

    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Body size of one block: K and V of every layer."""
        return (
            2
            * self.num_layers
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * self.itemsize
        )

    @property
    def namespace(self) -> str:
        """``pkv<version>:<model id>:<layers>x<kv heads>x<head dim>x<block size>:<dtype>``."""
        shape = f"{self.num_layers}x{self.num_kv_heads}x{self.head_dim}x{self.block_size}"
        return f"pkv{FORMAT_VERSION}:{self.model_id}:{shape}:{self.dtype}"

    @property
    def tag(self) -> str:
        """16 hex digits naming the namespace (xxh3-64), safe in file names."""
        return xxhash.xxh3_64_hexdigest(self.namespace.encode("utf-8"))


@dataclass(frozen=True, slots=True)
class PayloadHeader:
    """What a payload says about itself (the checksum is computed by :func:`encode`)."""

    layout: TierLayout
    block_hash: bytes
    num_tokens: int

    def __post_init__(self) -> None:
        if not 0 < len(self.block_hash) < 256:
            raise InvalidRequestError(
                f"a block hash must be 1..255 bytes, got {len(self.block_hash)}"
            )
        if not 0 < self.num_tokens <= self.layout.block_size:
            raise InvalidRequestError(
                f"num_tokens must be in [1, {self.layout.block_size}], got {self.num_tokens}"
            )


@dataclass(frozen=True, slots=True)
class BlockPayload:
    """A decoded payload: its header and a zero-copy view of its body."""

    header: PayloadHeader
    body: memoryview


def _pack_header(header: PayloadHeader, body_len: int, checksum: int) -> bytes:
    lay = header.layout
    dtype = lay.dtype.encode("ascii")
    model = lay.model_id.encode("utf-8")
    total = _FIXED.size + len(header.block_hash) + len(dtype) + len(model)
    fixed = _FIXED.pack(
        MAGIC,
        FORMAT_VERSION,
        total,
        lay.num_layers,
        lay.num_kv_heads,
        lay.head_dim,
        lay.block_size,
        header.num_tokens,
        0,
        body_len,
        checksum,
        len(header.block_hash),
        len(dtype),
        len(model),
    )
    return fixed + header.block_hash + dtype + model


def _checksum(header_zeroed: bytes | bytearray | memoryview, body: bytes | memoryview) -> int:
    h = xxhash.xxh3_64()
    h.update(header_zeroed)
    h.update(body)
    return int(h.intdigest())


def encode(header: PayloadHeader, body: bytes | bytearray | memoryview) -> bytes:
    """Header + body as one ``bytes`` (one copy of the body). The body must be exactly
    ``header.layout.block_bytes`` long."""
    view = memoryview(body).cast("B")
    expected = header.layout.block_bytes
    if view.nbytes != expected:
        raise InvalidRequestError(
            f"a block body for layout {header.layout.namespace} must be {expected} bytes, "
            f"got {view.nbytes}"
        )
    zeroed = _pack_header(header, expected, 0)
    checksum = _checksum(zeroed, view)
    packed = bytearray(zeroed)
    struct.pack_into("<Q", packed, _CHECKSUM_OFFSET, checksum)
    return b"".join((packed, view))


@functools.lru_cache(maxsize=256)
def _layout(
    model_id: str, layers: int, heads: int, hdim: int, bsize: int, dtype: str
) -> TierLayout:
    """Layouts are few: build and validate each once (a read parses one header per block)."""
    return TierLayout(model_id, layers, heads, hdim, bsize, dtype)


def _parse_header(data: memoryview) -> tuple[PayloadHeader, int, int]:
    """Header, header length and stored checksum; raises CorruptBlockError on any malformation."""
    if data.nbytes < _FIXED.size:
        raise CorruptBlockError(f"payload of {data.nbytes} bytes is shorter than a header")
    (
        magic,
        version,
        hlen,
        layers,
        heads,
        hdim,
        bsize,
        ntok,
        _reserved,
        body_len,
        checksum,
        hash_len,
        dtype_len,
        model_len,
    ) = _FIXED.unpack_from(data)
    if magic != MAGIC:
        raise CorruptBlockError(f"bad magic {bytes(magic)!r}; expected {MAGIC!r}")
    if version != FORMAT_VERSION:
        raise CorruptBlockError(f"payload format version {version}; expected {FORMAT_VERSION}")
    if hlen != _FIXED.size + hash_len + dtype_len + model_len or hlen > data.nbytes:
        raise CorruptBlockError(f"header length {hlen} is inconsistent (payload {data.nbytes} B)")
    pos = _FIXED.size
    block_hash = bytes(data[pos : pos + hash_len])
    pos += hash_len
    try:
        dtype = bytes(data[pos : pos + dtype_len]).decode("ascii")
        model_id = bytes(data[pos + dtype_len : hlen]).decode("utf-8")
        layout = _layout(model_id, layers, heads, hdim, bsize, dtype)
        header = PayloadHeader(layout, block_hash, ntok)
    except (UnicodeDecodeError, InvalidRequestError) as exc:
        raise CorruptBlockError(f"malformed payload header: {exc}") from None
    if body_len != layout.block_bytes:
        raise CorruptBlockError(
            f"header says {body_len} body bytes; its layout needs {layout.block_bytes}"
        )
    return header, hlen, int(checksum)


def read_header(data: bytes | bytearray | memoryview) -> PayloadHeader:
    """Parse only the header (no checksum): for sorting out foreign payloads cheaply."""
    header, _, _ = _parse_header(memoryview(data).cast("B"))
    return header


def decode(
    data: bytes | bytearray | memoryview,
    expected_layout: TierLayout,
    expected_hash: bytes | None = None,
    *,
    verify_checksum: bool = True,
) -> BlockPayload:
    """Check a payload and return its header and body.

    Raises :class:`CorruptBlockError` for a bad magic, version, header, layout (another model,
    shape or dtype), block hash (when ``expected_hash`` is given), size or checksum.
    ``verify_checksum=False`` skips only the checksum, for a payload a tier already verified.
    """
    view = memoryview(data).cast("B")
    header, hlen, checksum = _parse_header(view)
    if header.layout != expected_layout:
        raise CorruptBlockError(
            f"payload layout {header.layout.namespace} does not match {expected_layout.namespace}"
        )
    if expected_hash is not None and header.block_hash != expected_hash:
        raise CorruptBlockError(
            f"payload names block {header.block_hash.hex()}, expected {expected_hash.hex()}"
        )
    if view.nbytes != hlen + expected_layout.block_bytes:
        raise CorruptBlockError(
            f"payload is {view.nbytes} bytes; header and layout need "
            f"{hlen + expected_layout.block_bytes} (truncated or padded)"
        )
    body = view[hlen:]
    if verify_checksum:
        zeroed = bytearray(view[:hlen])
        struct.pack_into("<Q", zeroed, _CHECKSUM_OFFSET, 0)
        actual = _checksum(zeroed, body)
        if actual != checksum:
            raise CorruptBlockError(
                f"checksum mismatch for block {header.block_hash.hex()}: stored {checksum:016x}, "
                f"computed {actual:016x}"
            )
    return BlockPayload(header, body)


def payload_size(layout: TierLayout, block_hash_len: int = 16) -> int:
    """Bytes of one encoded payload (header + body) for ``layout``."""
    model = len(layout.model_id.encode("utf-8"))
    return _FIXED.size + block_hash_len + len(layout.dtype) + model + layout.block_bytes
