"""Row ranges of one tensor seen as one tensor again.

The runner computes a step's logits as one ``[rows, vocab]`` tensor and hands each request a
row range of it (a view). The sampler and the fault check want all the rows as one tensor
again; concatenating them copied the whole step's logits (16 x 49152 floats: 3 MB, ~0.3 ms a
decode step). :func:`joined_rows` returns the spanning view when the parts are consecutive
ranges of one contiguous tensor, in order, and a concatenated copy otherwise;
:func:`adjacent_view` only the view (None otherwise), for a caller that would rather not copy
(a bisected step's prompt-logprob rows can be hundreds of MB). Either way the
result's rows equal the parts' rows, in order; only whether it shares memory with them differs,
so a caller that writes into it must copy it first (as it must for a single part).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["adjacent_view", "joined_rows"]


def adjacent_view(parts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The rows of 2-D ``parts`` as one view of their common storage when each part is
    contiguous and starts where the previous one ends (the first part itself when there is
    one); None otherwise (and for no parts)."""
    if len(parts) == 1:
        return parts[0]
    if not parts or not _consecutive(parts):
        return None
    first = parts[0]
    rows = sum(p.shape[0] for p in parts)
    return first.as_strided((rows, first.shape[1]), (first.shape[1], 1))


def joined_rows(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)`` for 2-D ``parts``: :func:`adjacent_view` where there is one, else
    a copy. Raises as ``torch.cat`` does for no parts or mismatched widths."""
    view = adjacent_view(parts)
    return torch.cat(list(parts)) if view is None else view


def _consecutive(parts: Sequence[torch.Tensor]) -> bool:
    """Whether ``parts`` are adjacent row ranges of one storage, in order: the same dtype,
    device, width and storage, each contiguous, each starting where the previous ends."""
    first = parts[0]
    if first.dim() != 2:
        return False
    storage = first.untyped_storage().data_ptr()
    end = first.storage_offset()
    for p in parts:
        if (
            p.dim() != 2
            or p.dtype != first.dtype
            or p.device != first.device
            or p.shape[1] != first.shape[1]
            or not p.is_contiguous()
            or p.untyped_storage().data_ptr() != storage
            or p.storage_offset() != end
        ):
            return False
        end += p.numel()
    return True
