"""Paged KV tensors: one K and one V buffer per layer, indexed by KV head and block.

Layout per layer: ``[num_kv_heads, num_blocks, block_size, head_dim]`` (head-major). The
scheduler's slot numbers (``slot = block_id * block_size + offset``) address the middle of the
``[num_kv_heads, num_blocks * block_size, head_dim]`` view, so a write is one indexed copy.
Head-major, rather than ``[num_blocks, block_size, num_kv_heads, head_dim]``, because decode
attention is bound by memory traffic: one ``index_select`` over the ``[heads * blocks,
block_size * head_dim]`` view gathers a batch's context straight into the contiguous
``[seqs, kv_heads, positions, head_dim]`` shape attention reads, with no second copy
(benchmarks/RESULTS.md, engine section, has the measurement). A block of one head is one
contiguous slab; a block of all heads is ``num_kv_heads`` slabs.

The byte format of a block (``read_block``/``write_block``, what the tiers store) does not follow
the memory layout: it is every layer's K then every layer's V, each ``[block_size,
num_kv_heads, head_dim]`` (token-major), so payloads written by any layout stay readable.

Elastic pools grow by reallocation: a new buffer, one copy, the old one dropped. Chunked growth
would avoid the copy but make every gather span chunks; reallocation costs one memcpy of the
cache and happens O(log) times at most when the pool grows geometrically (see
benchmarks/RESULTS.md, engine section, for the measured cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.errors import CorruptBlockError, InvalidRequestError, InvariantViolation

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"float32"``/``"bfloat16"``/``"float16"`` (or the torch dtype itself) -> torch dtype."""
    if isinstance(name, torch.dtype):
        if name in _DTYPES.values():
            return name
        raise InvalidRequestError(f"unsupported dtype {name}; use one of {', '.join(_DTYPES)}")
    key = name.removeprefix("torch.")
    if key not in _DTYPES:
        raise InvalidRequestError(f"unsupported dtype {name!r}; use one of {', '.join(_DTYPES)}")
    return _DTYPES[key]


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shapes of the paged KV tensors."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"{name} must be positive, got {getattr(self, name)}")
        parse_dtype(self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block: the payload ``read_block`` returns."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * itemsize

    def num_blocks_for(self, budget_bytes: int) -> int:
        """How many blocks fit in ``budget_bytes`` (at least 2: the null block plus one)."""
        n = budget_bytes // self.bytes_per_block
        if n < 2:
            raise InvalidRequestError(
                f"a KV budget of {budget_bytes} bytes holds {n} blocks of "
                f"{self.bytes_per_block} bytes; at least 2 are needed"
            )
        return int(n)


class PagedKVCache:
    """Per-layer K/V buffers addressed by KV head, block id and slot (see the module docstring).

    Invariants (``check_invariants()`` verifies each):
      K1  every layer's K and V have shape ``[num_kv_heads, num_blocks, block_size, head_dim]``
      K2  all buffers share one dtype and device
      K3  a layer's K and V are the two halves of one ``[2, ...]`` tensor (``kv``), so one
          gather reads both
    Complexity: ``write`` O(tokens); ``copy_blocks`` O(copies x layers); ``grow`` O(cache size).
    """

    def __init__(
        self, spec: KVCacheSpec, num_blocks: int, device: torch.device | str = "cpu"
    ) -> None:
        if num_blocks <= 0:
            raise InvalidRequestError(f"num_blocks must be positive, got {num_blocks}")
        self.spec = spec
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.kv: list[torch.Tensor] = []  # per layer [2, ...]: K then V in one allocation
        self.k: list[torch.Tensor] = []  # views: self.kv[layer][0]
        self.v: list[torch.Tensor] = []  # views: self.kv[layer][1]
        for _ in range(spec.num_layers):
            self._set_layer(torch.zeros((2, *self._shape(num_blocks)), dtype=spec.dtype,
                                        device=self.device))  # fmt: skip
        self.num_grows = 0

    def _set_layer(self, kv: torch.Tensor, layer: int | None = None) -> None:
        if layer is None:
            self.kv.append(kv)
            self.k.append(kv[0])
            self.v.append(kv[1])
        else:
            self.kv[layer], self.k[layer], self.v[layer] = kv, kv[0], kv[1]

    def _shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        spec = self.spec
        return (spec.num_kv_heads, num_blocks, spec.block_size, spec.head_dim)

    @classmethod
    def from_budget(
        cls, spec: KVCacheSpec, budget_bytes: int, device: torch.device | str = "cpu"
    ) -> PagedKVCache:
        return cls(spec, spec.num_blocks_for(budget_bytes), device)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.spec.block_size

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block

    def grow(self, num_blocks: int) -> None:
        """Enlarge every buffer to ``num_blocks`` blocks, keeping their contents."""
        if num_blocks < self.num_blocks:
            raise InvalidRequestError(
                f"cannot shrink the KV cache from {self.num_blocks} to {num_blocks} blocks"
            )
        if num_blocks == self.num_blocks:
            return
        for layer, kv in enumerate(self.kv):
            new = torch.zeros((2, *self._shape(num_blocks)), dtype=kv.dtype, device=kv.device)
            new[:, :, : self.num_blocks].copy_(kv)
            self._set_layer(new, layer)
        self.num_blocks = num_blocks
        self.num_grows += 1

    # ------------------------------------------------------------------ writes
    def write(
        self, layer: int, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Store ``k``/``v`` (``[tokens, num_kv_heads, head_dim]``) at the given slots."""
        kf, vf = self._slot_views(layer)
        kf.index_copy_(1, slot_mapping, k.to(kf.dtype).transpose(0, 1))
        vf.index_copy_(1, slot_mapping, v.to(vf.dtype).transpose(0, 1))

    def copy_blocks(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks ``src -> dst`` in every layer (copy-on-write)."""
        if not pairs:
            return
        for src, dst in pairs:
            self._check_block(src)
            self._check_block(dst)
        src_idx = torch.tensor([p[0] for p in pairs], device=self.device)
        dst_idx = torch.tensor([p[1] for p in pairs], device=self.device)
        for bufs in (self.k, self.v):
            for buf in bufs:
                buf.index_copy_(1, dst_idx, buf.index_select(1, src_idx))

    # ------------------------------------------------------------------ reads
    def _slot_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        shape = (spec.num_kv_heads, -1, spec.head_dim)
        return self.k[layer].view(shape), self.v[layer].view(shape)

    def gather(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (1-D): ``[num_kv_heads, len(slots), head_dim]`` each."""
        kf, vf = self._slot_views(layer)
        return kf.index_select(1, slots), vf.index_select(1, slots)

    def head_block_index(self, block_ids: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's ``[2 * num_kv_heads * num_blocks, block_size * head_dim]`` view
        (K rows, then V rows) holding ``block_ids`` (``[rows, blocks]``) for every head: K's
        ``[rows, num_kv_heads, blocks]`` flattened, then V's. ``gather_heads`` takes it; valid
        until the cache grows."""
        per_kind = self.spec.num_kv_heads * self.num_blocks
        heads = torch.arange(self.spec.num_kv_heads, device=block_ids.device) * self.num_blocks
        k_rows = (heads[None, :, None] + block_ids[:, None, :]).reshape(-1)
        return torch.cat((k_rows, k_rows + per_kind))

    def gather_heads(
        self, layer: int, index: torch.Tensor, rows: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of whole blocks through ``head_block_index``: contiguous
        ``[rows, num_kv_heads, blocks * block_size, head_dim]`` each, from one ``index_select``
        over the layer's K and V (one allocation) and no further copy."""
        spec = self.spec
        flat = (2 * spec.num_kv_heads * self.num_blocks, spec.block_size * spec.head_dim)
        both = self.kv[layer].view(flat).index_select(0, index)
        half = index.shape[0] // 2
        shape = (rows, spec.num_kv_heads, -1, spec.head_dim)
        return both[:half].view(shape), both[half:].view(shape)

    # ------------------------------------------------------------------ tiers
    def read_block(self, block_id: int) -> bytes:
        """All layers' K then V of one block, as raw bytes (``spec.bytes_per_block`` long),
        each ``[block_size, num_kv_heads, head_dim]`` (see the module docstring)."""
        self._check_block(block_id)
        parts = [buf[:, block_id].transpose(0, 1) for buf in (*self.k, *self.v)]
        flat = torch.stack(parts).contiguous().cpu()
        if flat.dtype is torch.bfloat16:
            flat = flat.view(torch.int16)
        return bytes(flat.numpy().tobytes())

    def write_block(self, block_id: int, data: bytes) -> None:
        """Fill one block of every layer from ``read_block``'s bytes; checks the size."""
        self._check_block(block_id)
        spec = self.spec
        if len(data) != spec.bytes_per_block:
            raise CorruptBlockError(
                f"a block payload must be {spec.bytes_per_block} bytes for this layout "
                f"({spec.num_layers} layers x {spec.block_size} x {spec.num_kv_heads} x "
                f"{spec.head_dim}, {spec.dtype}); got {len(data)}"
            )
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        shape = (2 * spec.num_layers, spec.block_size, spec.num_kv_heads, spec.head_dim)
        parts = raw.view(spec.dtype).view(shape).to(self.device)
        for i, buf in enumerate((*self.k, *self.v)):
            buf[:, block_id].copy_(parts[i].transpose(0, 1))

    def _check_block(self, block_id: int) -> None:
        if not 0 <= block_id < self.num_blocks:
            raise InvalidRequestError(
                f"block id {block_id} is out of range; the KV cache holds {self.num_blocks} blocks"
            )

    def check_invariants(self) -> None:
        spec = self.spec
        shape = self._shape(self.num_blocks)
        for buf in (*self.k, *self.v):
            if tuple(buf.shape) != shape:
                raise InvariantViolation(f"K1: buffer shape {tuple(buf.shape)} != {shape}")
            if buf.dtype != spec.dtype or buf.device != self.device:
                raise InvariantViolation(f"K2: buffer is {buf.dtype} on {buf.device}")
        for kv, k, v in zip(self.kv, self.k, self.v, strict=True):
            if k.data_ptr() != kv.data_ptr() or v.data_ptr() != kv[1].data_ptr():
                raise InvariantViolation("K3: a layer's K and V are not the halves of its kv")
