"""A request as the scheduler sees it: prompt, limits, state and the tokens produced so far."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Sequence

from pagedkv.core.hashing import HashContext
from pagedkv.errors import InvalidRequestError


class RequestStatus(enum.Enum):
    """Where a request is. Finished states carry a :class:`FinishReason`."""

    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # holds blocks, scheduled every step
    PREEMPTED = "preempted"  # blocks freed under pressure, queued at the front to resume
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # blocks allocated, KV arriving from elsewhere
    LOADING = "loading"  # blocks allocated, prefix KV loading from a lower tier this step
    FINISHED = "finished"

    @property
    def is_finished(self) -> bool:
        return self is RequestStatus.FINISHED


class FinishReason(enum.Enum):
    """Why a request finished (OpenAI's ``finish_reason`` values where they exist)."""

    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # aborted by the caller (client gone, cancelled)
    ERROR = "error"  # failed inside the engine; other requests go on


class KVTransfer(enum.Enum):
    """Disaggregated serving role of a request's KV."""

    NONE = "none"
    RECEIVE = "receive"  # prompt KV is prefilled elsewhere and arrives before decode
    SEND = "send"  # KV is sent elsewhere after the request finishes; blocks held until confirmed


_arrival_counter = itertools.count()


_NO_STOP_IDS: frozenset[int] = frozenset()


class Request:
    """One generation request.

    Lower ``priority`` values are served first (as in vLLM); ties break by arrival time, then
    by the order ``add_request`` saw them. Token ids: ``all_token_ids`` = prompt + outputs.
    ``draft_token_ids`` are speculative drafts proposed for the next step (set by the engine).
    """

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "cache_salt",
        "draft_token_ids",
        "finish_reason",
        "hash_context",
        "kv_transfer",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "priority",
        "request_id",
        "seq_no",
        "status",
        "stop_token_ids",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int = 16,
        stop_token_ids: Sequence[int] = (),
        priority: int = 0,
        arrival_time: float = 0.0,
        cache_salt: str | None = None,
        hash_context: HashContext | None = None,
        kv_transfer: KVTransfer = KVTransfer.NONE,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {request_id!r}")
        if max_tokens <= 0:
            raise InvalidRequestError(f"max_tokens must be positive, got {max_tokens}")
        tokens = list(prompt_token_ids)
        # numpy ints, bools: convert (a list of ints: no). Counting exact-int types is ~30%
        # cheaper than building a set of them (the check is O(prompt) per request).
        if list(map(type, tokens)).count(int) != len(tokens):
            tokens = [int(t) for t in tokens]
        if not tokens:
            raise InvalidRequestError(f"request {request_id!r} has an empty prompt")
        self.request_id = request_id
        self.all_token_ids = tokens
        self.num_prompt_tokens = len(tokens)
        self.max_tokens = max_tokens
        # One shared empty set for the requests without stop ids (most): the decode step's
        # ``tok not in stop_token_ids`` then reads one hot object, not one cold per request.
        stops = frozenset(int(t) for t in stop_token_ids)
        self.stop_token_ids = stops if stops else _NO_STOP_IDS
        self.priority = priority
        self.arrival_time = arrival_time
        self.cache_salt = cache_salt
        self.hash_context = hash_context
        self.kv_transfer = kv_transfer
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit at the last admission
        self.num_preemptions = 0
        self.draft_token_ids: list[int] = []
        self.seq_no = next(_arrival_counter)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def sort_key(self) -> tuple[int, float, int]:
        """Serving order: priority, then arrival, then submission order."""
        return (self.priority, self.arrival_time, self.seq_no)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.value}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
