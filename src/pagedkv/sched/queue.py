"""Waiting queues: FCFS and priority, with O(1)/O(log n) operations and lazy removal.

An aborted request is not searched for in the queue (O(n)); it is marked finished and skipped
when it reaches the head. ``len()`` counts live requests only.
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Protocol

from pagedkv.sched.request import Request, RequestStatus

_QUEUED = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class WaitingQueue(Protocol):
    def push(self, request: Request) -> None:
        """Queue a new request in serving order."""

    def push_front(self, request: Request) -> None:
        """Queue a preempted request so it resumes before newer ones."""

    def try_peek(self) -> Request | None:
        """The next live request, or None when empty."""

    def pop(self) -> Request:
        """Remove and return the next live request (call after try_peek found one)."""

    def discard(self, request: Request) -> None:
        """Account for a queued request that was aborted (it is skipped lazily)."""

    def __len__(self) -> int: ...


class _LazyQueue:
    """What both queues share: ``_live`` counts the entries whose request is still queued;
    aborted ones stay in the container until ``try_peek`` skips them at the head."""

    _live: int

    def try_peek(self) -> Request | None:
        raise NotImplementedError

    def _drop_head(self) -> None:
        raise NotImplementedError

    def pop(self) -> Request:
        req = self.try_peek()
        if req is None:
            raise IndexError("pop from an empty waiting queue")
        self._drop_head()
        self._live -= 1
        return req

    def discard(self, request: Request) -> None:
        self._live -= 1

    def __len__(self) -> int:
        return self._live


class FCFSQueue(_LazyQueue):
    """First come, first served; preempted requests go to the front. O(1) amortised."""

    def __init__(self) -> None:
        self._q: deque[Request] = deque()
        self._live = 0  # == number of entries whose request is still queued

    def push(self, request: Request) -> None:
        self._q.append(request)
        self._live += 1

    def push_front(self, request: Request) -> None:
        self._q.appendleft(request)
        self._live += 1

    def try_peek(self) -> Request | None:
        q = self._q
        while q and q[0].status not in _QUEUED:
            q.popleft()
        return q[0] if q else None

    def _drop_head(self) -> None:
        self._q.popleft()


class PriorityQueue(_LazyQueue):
    """Lowest ``(priority, arrival_time, seq_no)`` first. O(log n) push/pop."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []
        self._live = 0

    def push(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort_key(), request))
        self._live += 1

    push_front = push  # a preempted request keeps its key, so it resumes before later arrivals

    def try_peek(self) -> Request | None:
        heap = self._heap
        while heap and heap[0][1].status not in _QUEUED:
            heapq.heappop(heap)
        return heap[0][1] if heap else None

    def _drop_head(self) -> None:
        heapq.heappop(self._heap)


def make_queue(policy: str) -> WaitingQueue:
    return PriorityQueue() if policy == "priority" else FCFSQueue()
