"""The scheduler's invariants, recomputed from scratch (see ``Scheduler``'s docstring)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.errors import InvariantViolation
from pagedkv.sched.request import RequestStatus

if TYPE_CHECKING:
    from pagedkv.sched.scheduler import Scheduler

_HOLDING = (
    RequestStatus.RUNNING,
    RequestStatus.WAITING_FOR_REMOTE_KV,
    RequestStatus.LOADING,
    RequestStatus.FINISHED,
)


def check_scheduler(sched: Scheduler) -> None:
    """Verify S1..S6 from scratch; raise InvariantViolation naming the broken one."""
    sched.manager.check_invariants()
    keys = [r.sort_key() for r in sched.running]
    if keys != sorted(keys):
        raise InvariantViolation("S2: the running list is out of serving order")
    active = len(sched.running) + len(sched.loading) + len(sched.remote_waiting)
    if active > sched.config.max_num_seqs:
        raise InvariantViolation(f"S2: {active} active requests > max_num_seqs")
    queued = 0
    running_ids = {id(r) for r in sched.running}
    for rid, req in sched.requests.items():
        st = req.status
        if st in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            queued += 1
        in_running = id(req) in running_ids
        if (st is RequestStatus.RUNNING) != in_running:
            raise InvariantViolation(f"S1: {rid} is {st.value} but in_running={in_running}")
        if (st is RequestStatus.LOADING) != (rid in sched.loading):
            raise InvariantViolation(f"S1: {rid} is {st.value} vs the loading set")
        if (st is RequestStatus.WAITING_FOR_REMOTE_KV) != (rid in sched.remote_waiting):
            raise InvariantViolation(f"S1: {rid} is {st.value} vs the remote wait set")
        if (st is RequestStatus.FINISHED) != (rid in sched.sending):
            raise InvariantViolation(f"S1: {rid} is {st.value} vs the sending set")
        if rid not in sched.manager:
            raise InvariantViolation(f"S4: {rid} is unfinished but unknown to the manager")
        if req.all_token_ids is not sched.manager.token_ids_view(rid):
            raise InvariantViolation(f"S6: {rid} does not share its token list with the manager")
        holds = bool(sched.manager.block_ids(rid))
        must_hold = st in _HOLDING
        if st is RequestStatus.RUNNING and req.num_computed_tokens == 0:
            must_hold = holds  # a failed tier load with no device prefix leaves none
        if holds != must_hold:
            raise InvariantViolation(f"S4: {rid} is {st.value} and holds blocks={holds}")
        if (
            st is RequestStatus.RUNNING
            and req.num_computed_tokens != sched.manager.num_computed_tokens(rid)
        ):
            raise InvariantViolation(f"S3: {rid} computed count differs from the manager's")
    if queued != len(sched.waiting):
        raise InvariantViolation(
            f"S1: {queued} queued requests but len(waiting)={len(sched.waiting)}"
        )
    placed = len(sched.running) + len(sched.remote_waiting) + len(sched.loading)
    if len(sched.requests) != queued + placed + len(sched.sending):
        raise InvariantViolation("S1: a request is in no place or in two")
