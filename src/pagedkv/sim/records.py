"""The finished requests of a simulation, one row each, kept in typed columns.

A :class:`RequestRecord` object per request costs ~200 bytes (the slotted object, three boxed
floats, boxed ints) and, being long-lived, pins the allocator's small-object pools that the
requests in flight churn through. :class:`RequestRecords` keeps the same facts in ``array``
columns (45 bytes a row) and names each request by its position in the workload, whose
:class:`~pagedkv.sim.workload.SimRequest` already holds the id, session and tag strings. It is a
read-only ``Sequence[RequestRecord]`` to its readers: indexing or iterating builds the record.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Sequence
from typing import Any, overload

from pagedkv.sim.report import RequestRecord
from pagedkv.sim.workload import SimRequest

_NONE = math.nan  # a time that did not happen (rejected: no first token, no finish)


class RequestRecords(Sequence[RequestRecord]):
    """Append-only rows, in the order requests finished (or were rejected).

    Invariants:
      I1  every column has ``len(self)`` entries
      I2  ``order[i]`` indexes ``requests``: row i is about ``requests[order[i]]``
      I3  ``first_s[i]``/``finish_s[i]`` are NaN exactly where the record's time is ``None``
    Complexity: ``append`` and ``self[i]`` O(1); equality O(rows).
    """

    __slots__ = (
        "arrival_s",
        "cached",
        "finish_s",
        "first_s",
        "order",
        "output",
        "preemptions",
        "prompt",
        "rejected",
        "requests",
    )

    def __init__(self, requests: Sequence[SimRequest]) -> None:
        self.requests = requests  # the workload's requests (not copied)
        self.order: array[int] = array("i")
        self.arrival_s: array[float] = array("d")
        self.first_s: array[float] = array("d")
        self.finish_s: array[float] = array("d")
        self.prompt: array[int] = array("i")
        self.output: array[int] = array("i")
        self.cached: array[int] = array("i")
        self.preemptions: array[int] = array("i")
        self.rejected: array[int] = array("b")

    def append(
        self,
        order: int,
        arrival_s: float,
        first_s: float | None,
        finish_s: float | None,
        counts: tuple[int, int, int, int],
        rejected: bool = False,
    ) -> None:
        """One row: ``requests[order]``'s times and its (prompt, output, cached, preemptions)."""
        self.order.append(order)
        self.arrival_s.append(arrival_s)
        self.first_s.append(_NONE if first_s is None else first_s)
        self.finish_s.append(_NONE if finish_s is None else finish_s)
        prompt, output, cached, preemptions = counts
        self.prompt.append(prompt)
        self.output.append(output)
        self.cached.append(cached)
        self.preemptions.append(preemptions)
        self.rejected.append(rejected)

    def __len__(self) -> int:
        return len(self.order)

    def _row(self, i: int) -> RequestRecord:
        sim = self.requests[self.order[i]]
        first, finish = self.first_s[i], self.finish_s[i]
        return RequestRecord(
            sim.request_id, sim.session_id, sim.tag, self.arrival_s[i],
            None if math.isnan(first) else first, None if math.isnan(finish) else finish,
            self.prompt[i], self.output[i], self.cached[i], self.preemptions[i],
            rejected=bool(self.rejected[i]),
        )  # fmt: skip

    @overload
    def __getitem__(self, i: int) -> RequestRecord: ...
    @overload
    def __getitem__(self, i: slice) -> tuple[RequestRecord, ...]: ...
    def __getitem__(self, i: int | slice) -> RequestRecord | tuple[RequestRecord, ...]:
        if isinstance(i, slice):
            return tuple(self._row(j) for j in range(*i.indices(len(self))))
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"record {i} of {n}")
        return self._row(i % n)

    def __iter__(self) -> Iterator[RequestRecord]:
        return (self._row(i) for i in range(len(self)))

    def tag_totals(self) -> dict[str, list[int]]:
        """tag -> [admitted requests, their prompt tokens, their cached tokens]."""
        out: dict[str, list[int]] = {}
        reqs = self.requests
        for j, rej, p, c in zip(self.order, self.rejected, self.prompt, self.cached, strict=True):
            if not rej:
                t = out.setdefault(reqs[j].tag, [0, 0, 0])
                t[0] += 1
                t[1] += p
                t[2] += c
        return out

    def _key(self) -> tuple[Any, ...]:
        reqs = self.requests
        names = tuple((reqs[j].request_id, reqs[j].session_id, reqs[j].tag) for j in self.order)
        nums = (self.prompt, self.output, self.cached, self.preemptions, self.rejected)
        times = (bytes(self.arrival_s), bytes(self.first_s), bytes(self.finish_s))  # NaN: None
        return (names, *times, *nums)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RequestRecords):
            return len(self) == len(other) and self._key() == other._key()
        if isinstance(other, Sequence):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash((len(self), bytes(self.arrival_s), bytes(self.finish_s)))

    def __repr__(self) -> str:
        return f"RequestRecords({len(self)} rows)"

    def __deepcopy__(self, memo: dict[int, Any]) -> RequestRecords:
        return self  # read-only once reported (dataclasses.asdict deep-copies what it keeps)
