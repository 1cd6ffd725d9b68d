"""What NIXL's exceptions mean to trio_pd: the one table, applied at the backend boundary.

Every place of the NIXL backend that catches an exception NIXL raised turns
it into the seam's :class:`~trio_pd._transfer._backend.BackendError` with
:func:`nixl_error`, and nowhere else: the transfer driver's thread and
inline reads store the error on the job, for the waiting task to raise; the
calls made in worker threads -- creating the agent and registering its
memory, remote-agent loads and unloads, notification polls, the releases at
close -- go through :func:`nixl_call`, which raises it in NIXL's place.

The table, :data:`NIXL_ERRORS`, is keyed by NIXL's exception class *name*:
the classes live in a binding module specific to the CUDA version
(``nixl_cu12._bindings``, ``nixl_cu13._bindings``), and one name matches
them all. A name not in the table maps to a plain :class:`BackendError`
that names it. The message is ``"<call>: <NIXL type>: <NIXL message>"``
(the connector's TransferError and HandshakeError quote it), and
``peer_lost`` is set for the types that mean the remote agent is gone.

Chaining, the one rule: a mapped error never chains NIXL's exception, as
``__cause__`` or as ``__context__``. That exception's traceback holds the
frames of the thread that made the call, with NIXL handles (transfer
handles, descriptor lists) in their locals, and every handle holds the
agent: an error a caller keeps (a TransferError's ``__cause__``, a log
record, a test's ``excinfo``) would keep the agent, its sockets and its
registered memory alive after the connector closed, and the driver
thread's frames with them. What NIXL said is kept as text instead: in the
message, and in ``BackendError.nixl_error`` (``"<type>: <message>"``).
:func:`nixl_call` raises the mapped error after its ``except`` block has
ended, so that Python does not set ``__context__`` either (``raise ...
from None`` would only hide it). The connector chains the other way round:
its public error has the ``BackendError`` as ``__cause__`` (see
:class:`~trio_pd.BackendError`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, TypeVar

import attrs

from trio_pd._transfer._backend import BackendClosing, BackendError, TransferTimeout

_T = TypeVar("_T")

logger = logging.getLogger("trio_pd.nixl")


@attrs.frozen
class NixlErrorKind:
    """What one of NIXL's exception types means to trio_pd.

    Attributes:
        meaning: what NIXL reports with it (NIXL's status code, in words).
        peer_lost: it means the remote agent is gone (died, restarted or
            unreachable): the consumer retires the agent and handshakes again.
    """

    meaning: str
    peer_lost: bool = False


NIXL_ERRORS: Mapping[str, NixlErrorKind] = MappingProxyType(
    {
        "nixlRemoteDisconnectError": NixlErrorKind(
            "the remote agent disconnected: its engine died, restarted or became unreachable "
            "(NIXL_ERR_REMOTE_DISCONNECT)",
            peer_lost=True,
        ),
        "nixlNotFoundError": NixlErrorKind(
            "what the call names is unknown to the agent: a remote agent not loaded, a "
            "backend plugin not found (NIXL_ERR_NOT_FOUND)"
        ),
        "nixlInvalidParamError": NixlErrorKind(
            "the call's arguments were refused: metadata, descriptors, indices "
            "(NIXL_ERR_INVALID_PARAM)"
        ),
        "nixlBackendError": NixlErrorKind(
            "the backend plugin (UCX) failed in the call (NIXL_ERR_BACKEND)"
        ),
        "nixlMismatchError": NixlErrorKind(
            "descriptors that must match do not: memory types, lengths (NIXL_ERR_MISMATCH)"
        ),
        "nixlNotAllowedError": NixlErrorKind(
            "the call is not allowed in the agent's present state (NIXL_ERR_NOT_ALLOWED)"
        ),
        "nixlNotSupportedError": NixlErrorKind(
            "the backend plugin does not support the operation (NIXL_ERR_NOT_SUPPORTED)"
        ),
        "nixlNotPostedError": NixlErrorKind("the transfer was not posted (NIXL_ERR_NOT_POSTED)"),
        "nixlRepostActiveError": NixlErrorKind(
            "a transfer was posted again while it still ran (NIXL_ERR_REPOST_ACTIVE)"
        ),
        "nixlCancelledError": NixlErrorKind("NIXL cancelled the operation (NIXL_ERR_CANCELED)"),
        "nixlNoTelemetryError": NixlErrorKind(
            "telemetry was asked for but is off (NIXL_ERR_NO_TELEMETRY)"
        ),
        "nixlUnknownError": NixlErrorKind("NIXL gave no reason (NIXL_ERR_UNKNOWN)"),
    }
)
"""NIXL's exception types by class name (NIXL 1.5), and what each means."""

UNKNOWN = NixlErrorKind("an exception the table does not know: mapped as a failed call")
"""What a type not in :data:`NIXL_ERRORS` means."""

PASS_THROUGH: tuple[type[Exception], ...] = (BackendError, TransferTimeout, BackendClosing)
"""trio_pd's own exceptions, which :func:`nixl_call` lets through unchanged."""


def describe(exc: BaseException) -> str:
    """``Type: message`` (or just the type when the message is empty)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def nixl_error(call: str, exc: BaseException) -> BackendError:
    """The trio_pd error for NIXL's ``exc``, raised by ``call``: the one mapping.

    A :class:`BackendError` whose message is ``"<call>: <type>: <message>"``,
    with ``nixl_error`` (``"<type>: <message>"``) and ``peer_lost`` as the
    table says for ``exc``'s type. It holds no reference to ``exc``: raise
    it outside the ``except`` block that caught ``exc`` (as :func:`nixl_call`
    does), or store it, so that ``__context__`` does not hold ``exc`` either.
    """
    kind = NIXL_ERRORS.get(type(exc).__name__, UNKNOWN)
    text = describe(exc)
    return BackendError(f"{call}: {text}", peer_lost=kind.peer_lost, nixl_error=text)


def nixl_call(call: str, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)``; an exception it raises is raised as :func:`nixl_error`'s
    error (named ``call``), chaining nothing.

    trio_pd's own exceptions (:data:`PASS_THROUGH`) pass through unchanged,
    and so do BaseExceptions (``trio.Cancelled``, KeyboardInterrupt).
    """
    try:
        return fn(*args)
    except PASS_THROUGH:
        raise
    except Exception as exc:
        error = nixl_error(call, exc)
    raise error  # (here, not in the except block: no __context__)


def release_or_keep(handle: Any, kept: list[Any]) -> None:
    """Release a transfer handle; one NIXL refuses to release goes to ``kept``
    (released at close), with an error logged."""
    try:
        nixl_call("release", handle.release)
    except BackendError as exc:
        logger.error("transfer handle could not be released (%s); kept until close", exc.nixl_error)
        kept.append(handle)
