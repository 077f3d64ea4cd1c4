"""Typed errors of pagedkv.

Every error raised for a user's mistake or a resource limit derives from :class:`PagedKVError`
and, where one fits, from the matching builtin, so ``except ValueError`` still works for callers
that do not know pagedkv. Messages carry the offending value and the limit it broke.

Hierarchy::

    PagedKVError
    ├── InvalidRequestError(ValueError)      bad sizes, bad tokens, bad sampling values
    │   ├── PromptTooLongError               a prompt that can never fit
    │   └── UnsupportedParameterError        a request parameter the server does not implement
    ├── UnknownRequestError(KeyError)        a request id the component does not hold
    ├── RequestStateError(RuntimeError)      a valid id in the wrong state (double free, ...)
    ├── RollbackError(ValueError)            a rollback that would cut committed tokens
    ├── OutOfBlocksError(RuntimeError)       not enough free blocks right now (retry later)
    ├── CacheBusyError(RuntimeError)         reset/clear refused while blocks are in use
    ├── CorruptBlockError(ValueError)        a stored block payload failed its checks
    ├── TierUnavailableError(ConnectionError) a storage tier cannot be reached
    ├── ModelLoadError(ValueError)           missing files or unsupported architecture
    ├── OverloadedError(RuntimeError)        a queue is full (the server answers 429)
    ├── ModelExecutionError(RuntimeError)    the model step or sampling failed for one request
    ├── SimulationLimitError(RuntimeError)   a simulation passed a user-set limit (max_steps)
    └── InvariantViolation(RuntimeError)     an internal invariant broke: a bug, never user error
"""

from __future__ import annotations


class PagedKVError(Exception):
    """Root of every error pagedkv raises on purpose."""


class InvalidRequestError(PagedKVError, ValueError):
    """The caller passed a value that can never be valid (negative size, bad token id, ...)."""


class PromptTooLongError(InvalidRequestError):
    """A prompt that can never fit in the model's context or in the whole block pool."""


class UnsupportedParameterError(InvalidRequestError):
    """A request parameter set to a value the server does not implement; ``param`` names it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class UnknownRequestError(PagedKVError, KeyError):
    """A request id that the component does not hold (never added, or already freed)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else "unknown request"


class RequestStateError(PagedKVError, RuntimeError):
    """A known request in a state that does not allow the operation (e.g. allocate while held)."""


class SchedulerStateError(PagedKVError, RuntimeError):
    """``schedule()``/``update()`` called out of order (a step scheduled twice, or the update of
    a step that is not the outstanding one); nothing was changed."""


class RollbackError(PagedKVError, ValueError):
    """A speculative rollback that would remove committed tokens; nothing was changed."""


class OutOfBlocksError(PagedKVError, RuntimeError):
    """Not enough free blocks for an all-or-nothing allocation; nothing was changed."""


class CacheBusyError(PagedKVError, RuntimeError):
    """A whole-cache operation (reset, clear) refused because blocks are still in use."""


class CorruptBlockError(PagedKVError, ValueError):
    """A stored block payload failed its header, layout or checksum check."""


class TierUnavailableError(PagedKVError, ConnectionError):
    """A storage tier (disk, Redis/Valkey) cannot be reached right now."""


class StateFileError(PagedKVError, ValueError):
    """A state file (the router's ``--engine-state-file``) cannot be read, parsed or written;
    the message names the file."""


class ModelLoadError(PagedKVError, ValueError):
    """A model folder is missing files, or names an architecture pagedkv does not support."""


class OverloadedError(PagedKVError, RuntimeError):
    """A bounded queue is full; the caller should retry later."""


class ModelExecutionError(PagedKVError, RuntimeError):
    """The model step or sampling failed for one request (non-finite logits, a kernel error);
    that request finishes with ``finish_reason="error"``, the others go on."""


class SimulationLimitError(PagedKVError, RuntimeError):
    """A simulation reached a limit its caller set (``max_steps``) before every request finished.

    Not a bug: the workload needs more steps than allowed; raise the limit or shrink the workload.
    """


class InvariantViolation(PagedKVError, RuntimeError):  # noqa: N818  (the name STYLE.md gives)
    """An internal invariant does not hold. Always a bug in pagedkv, never a user error.

    The message starts with the invariant's label from the class docstring, e.g. ``"I2: ..."``.
    """
