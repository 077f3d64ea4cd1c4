"""The second half of a scheduler step: ``update`` applies what the runner computed.

For each scheduled request still running, in step order: commit the computed positions, append
the accepted tokens, roll back rejected drafts, and finish it on a stop (``check_stop``, the one
stop check; ``stop_reason_one`` and its inlined copy for one token), freeing or holding its
blocks. All or nothing: ``_validate_update`` checks everything before anything changes.

The common case takes a shorter path: a run of plain decodes (one position, no window) that do
not finish changes only those requests, so it is committed by one ``commit_decodes`` call, made
just before the next other item (a finish, a prefill commit, drafts), so every call that
reaches the pool keeps its order.

A part of :class:`~pagedkv.sched.scheduler.Scheduler` (a mixin over its state).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from pagedkv.errors import InvalidRequestError, SchedulerStateError
from pagedkv.sched.kv_sharing import KVSharingMixin
from pagedkv.sched.output import RequestOutput, ScheduledRequest, SchedulerOutput
from pagedkv.sched.request import FinishReason, KVTransfer, Request, RequestStatus
from pagedkv.sched.step_plan import check_stop, is_token_id, stop_reason_one

if TYPE_CHECKING:
    from pagedkv.core.config import CacheConfig

_MAX_TOKEN_ID = 2**32

# A run of plain decodes that do not finish: their ids, sampled tokens and requests.
_Run = tuple[list[str], list[int], list[Request]]
# Any other scheduled request still running: the run before it, the request, its entry and its
# sampled tokens (None: it only commits).
_Item = tuple[_Run, Request, ScheduledRequest, Sequence[int] | None]


def _check_sampled(sr: ScheduledRequest, toks: Sequence[int] | None) -> None:
    """Raise InvalidRequestError unless ``toks`` are 1 to ``1 + drafts`` valid token ids."""
    if toks is None or not 1 <= len(toks) <= 1 + sr.num_draft_tokens:
        raise InvalidRequestError(
            f"request {sr.request_id!r} needs 1 to {1 + sr.num_draft_tokens} sampled "
            f"tokens, got {None if toks is None else len(toks)}"
        )
    if not all(map(is_token_id, toks)):
        raise InvalidRequestError(
            f"request {sr.request_id!r} sampled {list(toks)}: token ids must be "
            "integers in [0, 2**32)"
        )


class StepUpdateMixin(KVSharingMixin):
    """``update`` and finishing for ``Scheduler`` (which provides this state)."""

    cache_config: CacheConfig
    max_len: int
    num_finished: int
    _finished_ids: list[str]
    _outstanding: SchedulerOutput | None

    def check_invariants(self) -> None:
        raise NotImplementedError

    def update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, Sequence[int]],
        *,
        failed_loads: Collection[str] = (),
    ) -> list[RequestOutput]:
        """Apply a step's results: ``sampled[rid]`` holds the accepted tokens of every sampling
        request (accepted drafts, then the bonus token). Returns one output per sampling request.

        Requests in ``output.loading_ids`` become running with their loaded prefix committed,
        except those in ``failed_loads``: they drop the loaded blocks and recompute.
        All or nothing: everything is validated first; SchedulerStateError (not the outstanding
        step) or InvalidRequestError (bad sampled tokens, unknown failed loads) change nothing.
        """
        items, last_run = self._validate_update(output, sampled, failed_loads)
        self._outstanding = None
        outputs = self._apply_work(items, last_run)
        for rid in output.loading_ids:
            req_l = self.loading.pop(rid, None)
            if req_l is not None:
                self._finish_load(req_l, success=rid not in failed_loads)
        if self.config.check_invariants:
            self.check_invariants()
        return outputs

    def _validate_update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, Sequence[int]],
        failed_loads: Collection[str],
    ) -> tuple[list[_Item], _Run]:
        """Check everything ``update`` will apply, changing nothing. Returns, in step order, the
        other items (each after the run of plain decodes before it) and the last run.
        A run holds plain decodes (one position, no window) that do not finish: each changes
        only its own request, so a run is committed by one ``commit_decodes`` call just before
        the item after it, and every call that reaches the pool keeps its order."""
        if output is not self._outstanding:
            raise SchedulerStateError(
                f"update() got step {output.step}, but the outstanding step is "
                f"{None if self._outstanding is None else self._outstanding.step}"
            )
        requests, running, max_len = self.requests, RequestStatus.RUNNING, self.max_len
        plain = self.cache_config.sliding_window is None
        items: list[_Item] = []
        ids: list[str] = []
        tokens: list[int] = []
        reqs: list[Request] = []
        for sr in output.scheduled:
            rid = sr.request_id
            req = requests.get(rid)
            if req is None or req.status is not running:
                continue  # aborted or finished since schedule(): nothing to apply
            toks = sampled.get(rid) if sr.samples else None
            if toks is not None and len(toks) == 1 and sr.num_tokens == 1 and plain:
                tok = toks[0]
                num_after = len(req.all_token_ids) + 1  # stop_reason_one, inlined
                if (
                    type(tok) is int
                    and 0 <= tok < _MAX_TOKEN_ID
                    and tok not in req.stop_token_ids
                    and num_after - req.num_prompt_tokens < req.max_tokens
                    and num_after < max_len
                ):
                    ids.append(rid)
                    tokens.append(tok)
                    reqs.append(req)
                    continue
            if sr.samples:
                _check_sampled(sr, toks)
            items.append(((ids, tokens, reqs), req, sr, toks))
            ids, tokens, reqs = [], [], []
        unknown = set(failed_loads).difference(output.loading_ids)
        if unknown:
            raise InvalidRequestError(
                f"failed_loads names {sorted(unknown)}, which step {output.step} did not load"
            )
        return items, (ids, tokens, reqs)

    def _apply_work(self, items: list[_Item], last_run: _Run) -> list[RequestOutput]:
        """Apply validated work in step order (each run of plain decodes, one manager call,
        then the item after it); return the sampling requests' outputs. Cannot fail."""
        windowed = self.cache_config.sliding_window is not None
        results: list[RequestOutput] = []
        for run, req, sr, toks in items:
            if run[0]:
                self._commit_run(run, results)
            if toks is None:
                self.manager.commit(req.request_id, sr.num_tokens)
                req.num_computed_tokens += sr.num_tokens
                if windowed:
                    self._release_outside_window(req)
            elif sr.num_tokens == 1 and not windowed:  # a plain decode that finishes
                results.append(self._apply_decode(req, toks[0]))
            else:
                results.append(self._apply_sampled(req, sr, toks, windowed))
        if last_run[0]:
            self._commit_run(last_run, results)
        return results

    def _commit_run(self, run: _Run, results: list[RequestOutput]) -> None:
        """Commit a run of plain decodes that do not finish (one manager call) and append their
        outputs."""
        ids, tokens, reqs = run
        self.manager.commit_decodes(ids, tokens)  # validated: cannot fail
        append = results.append
        new = object.__new__  # each record made without a constructor call (decode_entries')
        for rid, req, tok in zip(ids, reqs, tokens, strict=True):
            req.num_computed_tokens += 1  # == the manager's count (S3)
            if req.draft_token_ids:
                req.draft_token_ids = []
            # == RequestOutput(rid, (tok,), False, None, num_prompt_tokens, num_cached_tokens)
            o = new(RequestOutput)
            o.request_id = rid
            o.new_token_ids = (tok,)
            o.finished = False
            o.finish_reason = None
            o.num_prompt_tokens = req.num_prompt_tokens
            o.num_cached_tokens = req.num_cached_tokens
            append(o)

    def _apply_sampled(
        self, req: Request, sr: ScheduledRequest, toks: Sequence[int], windowed: bool
    ) -> RequestOutput:
        """Append a sampling request's accepted tokens, commit them, roll back rejected drafts,
        and finish it on a stop (``check_stop``). Validated already: cannot fail."""
        rid = req.request_id
        mgr = self.manager
        final, reason = check_stop(req, toks, self.max_len)
        accepted = len(final) - 1
        num_committed = sr.num_tokens - sr.num_draft_tokens + accepted
        mgr.append_and_commit(rid, final, num_committed)  # req.all_token_ids too (S6)
        rejected = sr.num_draft_tokens - accepted
        if rejected:
            mgr.rollback(rid, rejected)
        req.num_computed_tokens += num_committed  # == the manager's count (S3)
        if windowed:
            self._release_outside_window(req)
        return self._end_of_step(req, tuple(final), reason)

    def _apply_decode(self, req: Request, token_id: int) -> RequestOutput:
        """``_apply_sampled`` for a plain decode (one position, no drafts, no window): append
        and commit the token, finish on a stop. Validated already: cannot fail."""
        tok = token_id if type(token_id) is int else int(token_id)
        reason = stop_reason_one(req, tok, self.max_len)
        final = (tok,)
        self.manager.append_and_commit(req.request_id, final, 1)  # req.all_token_ids too (S6)
        req.num_computed_tokens += 1  # == the manager's count (S3)
        return self._end_of_step(req, final, reason)

    def _end_of_step(
        self, req: Request, final: tuple[int, ...], reason: FinishReason | None
    ) -> RequestOutput:
        """A sampled request's drafts are spent; it finishes on a stop; its output record."""
        if req.draft_token_ids:
            req.draft_token_ids = []
        if reason is not None:
            self._remove_running(req)
            self._finish(req, reason)
        return RequestOutput(
            req.request_id,
            final,
            reason is not None,
            reason,
            req.num_prompt_tokens,
            req.num_cached_tokens,
        )

    def _finish(self, req: Request, reason: FinishReason) -> None:
        """Mark a request finished (already out of the running list) and free or hold its KV."""
        rid = req.request_id
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.num_finished += 1
        self._finished_ids.append(rid)
        if req.kv_transfer is KVTransfer.SEND and reason is not FinishReason.ABORT:
            mgr = self.manager
            pending = mgr.num_pending_tokens(rid)
            if pending:
                mgr.rollback(rid, pending)
            mgr.hold(rid)
            self.sending[rid] = req
            return
        self.manager.free(rid)
        del self.requests[rid]

    def _remove_running(self, req: Request) -> None:
        running = self.running
        i = bisect.bisect_left(running, req.sort_key(), key=Request.sort_key)
        if i < len(running) and running[i] is req:
            del running[i]
        else:  # pragma: no cover - S2 guarantees the bisect finds it
            running.remove(req)

    def _release_outside_window(self, req: Request) -> None:
        """Sliding-window models: free the blocks before the request's window (after commit).
        A request that will send its KV to another engine keeps it whole."""
        if self.cache_config.sliding_window is not None and req.kv_transfer is not KVTransfer.SEND:
            self.manager.release_outside_window(req.request_id)
