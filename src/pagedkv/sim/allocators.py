"""KV allocators to compare paged attention against (``--compare allocator=...``).

The PagedAttention paper (Kwon et al., SOSP'23, section 6) compares vLLM with Orca under three
contiguous reservation policies; the simulator models each by what it reserves when a request
is admitted, on the real scheduler:

==========  =================================================================================
paged       blocks allocated as tokens arrive; admission reserves as ``--reservation`` says
max         contiguous: every request reserves ``max_model_len`` tokens ("Orca (Max)")
pow2        contiguous: the next power of two of its true prompt + output ("Orca (Pow2)")
oracle      contiguous: exactly its true prompt + output ("Orca (Oracle)")
==========  =================================================================================

A contiguous variant runs with 1-token blocks over the same usable tokens (so no block
rounding: the waste is the reservation), admission reserving the prompt plus ``max_tokens``
set to the reservation's output part, and prefix caching off (a contiguous buffer is private).
Its *allocated* usage is the reservation: used blocks plus the running requests' claim. The
request still ends at its true length: the simulated model emits a stop token there.
"""

from __future__ import annotations

from enum import Enum


class Allocator(Enum):
    PAGED = "paged"
    MAX = "max"
    POW2 = "pow2"
    ORACLE = "oracle"

    @property
    def is_contiguous(self) -> bool:
        return self is not Allocator.PAGED


def reserved_max_tokens(
    allocator: Allocator, num_prompt_tokens: int, output_len: int, max_tokens: int, max_len: int
) -> int:
    """The ``max_tokens`` the scheduler is given, so that admission reserves what ``allocator``
    reserves (at least 1, at most what ``max_len`` leaves after the prompt)."""
    room = max(1, max_len - num_prompt_tokens)
    if allocator is Allocator.PAGED:
        return max_tokens
    if allocator is Allocator.MAX:
        return room
    total = num_prompt_tokens + output_len
    if allocator is Allocator.POW2:
        total = 1 << (total - 1).bit_length()
    return max(1, min(room, total - num_prompt_tokens))
