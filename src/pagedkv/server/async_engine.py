"""The engine behind the HTTP server: one step loop in its own thread, async streams per request.

The ``LLMEngine`` is single-threaded by design. Handlers add requests under ``_lock`` from a
worker thread (``add_request`` is quick and raises typed errors synchronously, so a bad request
gets its 400 at once); the step thread holds the same lock for each ``step()``, and between two
steps it lets the handlers waiting for it in first (``HandoffLock``: otherwise a busy loop takes
it again before they run, and ``/metrics`` or a new request waits many steps). Aborts never
wait for that lock on the event loop: they are queued and the step thread applies them before
its next step. Outputs travel to each request's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``.

Health: ``is_healthy()`` is False once the step loop died, and while work is pending but no step
has finished for ``stall_timeout_s`` (a step stuck in a kernel, a deadlock): ``/health`` then
answers 503 so an orchestrator can restart the process.

Invariants:
  A1  ``_streams`` holds exactly the requests added and not yet finished or aborted (an abort
      queued in ``_aborts`` is applied before the next step)
  A2  only the step thread calls ``LLMEngine.step`` and ``LLMEngine.abort``; every engine call
      holds ``_lock``
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass

from pagedkv.engine.llm_engine import LLMEngine
from pagedkv.engine.outputs import GenerationOutput
from pagedkv.engine.sampler import SamplingParams
from pagedkv.errors import InvariantViolation, OverloadedError
from pagedkv.obs.metrics import Metrics
from pagedkv.server.handoff_lock import HandoffLock

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
    queue: asyncio.Queue[GenerationOutput | BaseException]
    loop: asyncio.AbstractEventLoop
    arrival_s: float
    num_prompt_tokens: int = 0
    last_token_s: float | None = None
    num_tokens: int = 0
    first_token_s: float | None = None
    queue_s: float | None = None  # the engine's arrival to first scheduled


class AsyncEngine:
    """Runs ``LLMEngine.step`` in a background thread and streams outputs to coroutines."""

    def __init__(
        self,
        engine: LLMEngine,
        *,
        max_pending: int = 256,
        model_name: str = "",
        stall_timeout_s: float = 60.0,
    ) -> None:
        if stall_timeout_s <= 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        self.engine = engine
        self.max_pending = max_pending
        self.stall_timeout_s = stall_timeout_s
        self._last_progress_s = time.monotonic()  # the loop's last finished step or idle wait
        self.model_name = model_name
        self.metrics = Metrics(model_name)
        self._lock = HandoffLock()  # handlers enter with ``with``, the step thread for_step()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._aborts: deque[str] = deque()  # thread-safe appends; drained by the step thread
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="pagedkv-engine", daemon=True)
        self.healthy = True

    def start(self) -> None:
        self._thread.start()

    def is_healthy(self) -> bool:
        """False once the step loop died (it keeps running through failed requests), or while
        requests are pending and no step finished for ``stall_timeout_s``."""
        alive = self.healthy and (self._thread.is_alive() or self._thread.ident is None)
        return alive and not self.is_stalled()

    def is_stalled(self) -> bool:
        """Work is pending and the step loop has not advanced for ``stall_timeout_s``."""
        idle_s = time.monotonic() - self._last_progress_s
        return bool(self._streams) and idle_s > self.stall_timeout_s

    def shutdown(self) -> None:
        """Stop the step loop, fail what is still in flight (the server drained what it could
        within its shutdown timeout), then flush and close the engine's KV tiers."""
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._lock:
            self._apply_aborts()
            self._fail_all(RuntimeError("the server is shutting down"))
            self.engine.close()

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self._ids)}-{int(time.time() * 1000)}"

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> AsyncGenerator[GenerationOutput, None]:
        """Add a request and yield its outputs until it finishes. Cancelling aborts it.
        ``cache_salt`` as :meth:`LLMEngine.add_request`.

        Raises the engine's typed errors (bad input) or OverloadedError before yielding.
        """
        loop = asyncio.get_running_loop()
        stream = _Stream(asyncio.Queue(), loop, time.perf_counter(), len(prompt_token_ids))
        # The lock may be held for a whole step: wait for it off the event loop. If this
        # coroutine is cancelled meanwhile (the client went away), the add still completes in
        # its thread, so abort the request once it has.
        add = asyncio.ensure_future(
            asyncio.to_thread(
                self._add, request_id, list(prompt_token_ids), params, stream, cache_salt
            )
        )
        try:
            await asyncio.shield(add)
        except asyncio.CancelledError:
            add.add_done_callback(functools.partial(self._abort_if_added, request_id))
            raise
        self._wake.set()
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def _add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        stream: _Stream,
        cache_salt: str | None,
    ) -> None:
        with self._lock:
            if len(self._streams) >= self.max_pending:
                raise OverloadedError(
                    f"{len(self._streams)} requests in flight (limit {self.max_pending}); "
                    "retry later"
                )
            self.engine.add_request(request_id, prompt, params, cache_salt=cache_salt)
            self._streams[request_id] = stream

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still in flight (a client went away); the step thread frees
        its blocks before its next step. Never blocks."""
        self._aborts.append(request_id)
        self._wake.set()

    def _abort_if_added(self, request_id: str, add: asyncio.Future[None]) -> None:
        if not add.cancelled() and add.exception() is None:
            self.abort(request_id)

    def _apply_aborts(self) -> None:
        while self._aborts:
            rid = self._aborts.popleft()
            stream = self._streams.pop(rid, None)
            if stream is not None:
                with contextlib.suppress(KeyError):  # it finished in the same instant
                    self.engine.abort(rid)
                self._observe_finished(stream, "abort")

    def check_invariants(self) -> None:
        """A1 and the engine's own invariants (takes the lock: call from any thread)."""
        with self._lock:
            self._apply_aborts()
            if len(self._streams) != self.engine.num_unfinished_requests:
                raise InvariantViolation(
                    f"A1: {len(self._streams)} streams for "
                    f"{self.engine.num_unfinished_requests} unfinished engine requests"
                )
            self.engine.check_invariants()

    def reset_prefix_cache(self, reset_running: bool = False) -> None:
        """``LLMEngine.reset_prefix_cache`` between two steps (takes the lock)."""
        with self._lock:
            self._apply_aborts()
            self.engine.reset_prefix_cache(reset_running)

    def kv_events_snapshot(self) -> tuple[int, list[bytes]]:
        """``LLMEngine.kv_events_snapshot`` between two steps (takes the lock)."""
        with self._lock:
            return self.engine.kv_events_snapshot()

    def stats_snapshot(self) -> None:
        """Refresh the gauges from the scheduler (called after each step and by /metrics)."""
        with self._lock:
            self._observe()

    def _observe(self) -> None:
        """Export the scheduler's and every KV tier's counters (hold ``_lock``)."""
        self.metrics.observe_scheduler(self.engine.scheduler.stats())
        if self.engine.tier_io is not None:
            for tier in self.engine.tier_io.tier_stats():
                self.metrics.observe_tier(tier.name, tier)
            self.metrics.observe_queue_drops(self.engine.tier_io.offload.stats().dropped_queue_full)

    # ------------------------------------------------------------------ step thread
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._step_once()
        except BaseException as exc:  # a bug outside step(): fail everyone, report unhealthy
            logger.exception("engine loop died")
            self.healthy = False
            with self._lock:
                self._fail_all(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))
            # the thread ends here (logged above); /health now answers 503

    def _step_once(self) -> None:
        with self._lock.for_step():
            self._apply_aborts()
            busy = self.engine.has_unfinished_requests()
            outputs: list[GenerationOutput] = []
            if busy:
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # a bug in a step: fail those in flight, keep serving
                    logger.exception("engine step failed")
                    self._fail_all(exc)
                self._observe()
            now = time.perf_counter()
            for out in outputs:
                self._deliver(out, now)
            self._last_progress_s = time.monotonic()
        if not busy:
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            self._last_progress_s = time.monotonic()

    def _deliver(self, out: GenerationOutput, now: float) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        if out.queue_s is not None:
            stream.queue_s = out.queue_s
        if num_tokens > stream.num_tokens:
            vllm = self.metrics.vllm
            if stream.last_token_s is None:
                stream.first_token_s = now
                self.metrics.ttft.observe(now - stream.arrival_s)
                vllm.ttft.labels(self.model_name).observe(now - stream.arrival_s)
            else:
                new = num_tokens - stream.num_tokens
                gap = (now - stream.last_token_s) / new
                itl = vllm.itl.labels(self.model_name)
                for _ in range(new):
                    self.metrics.itl.observe(gap)
                    itl.observe(gap)
            stream.last_token_s = now
            stream.num_tokens = num_tokens
        if out.finished:
            del self._streams[out.request_id]
            reasons = [c.finish_reason or "stop" for c in out.outputs]
            self._observe_finished(stream, "error" if "error" in reasons else reasons[0])
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _observe_finished(self, stream: _Stream, reason: str) -> None:
        e2e_s = time.perf_counter() - stream.arrival_s
        self.metrics.observe_finished(stream.num_prompt_tokens, stream.num_tokens, reason, e2e_s)
        first, last, queue_s = stream.first_token_s, stream.last_token_s, stream.queue_s
        if first is not None and last is not None and queue_s is not None:
            prefill_s = max(0.0, first - stream.arrival_s - queue_s)
            self.metrics.vllm.observe_phases(queue_s, prefill_s, last - first, stream.num_tokens)

    def _fail_all(self, exc: Exception) -> None:
        for rid, stream in list(self._streams.items()):
            with contextlib.suppress(KeyError):
                self.engine.abort(rid)
            with contextlib.suppress(RuntimeError):  # its event loop already closed
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, exc)
            self._observe_finished(stream, "error")
        self._streams.clear()
