"""What NIXL's exceptions mean to trio_pd: the one mapping into :class:`BackendError`.

Used by the NIXL backend (handshake and notification calls) and by its
transfer driver (reads and notifications).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import trio

from trio_pd._transfer._backend import BackendClosing, BackendError, TransferTimeout

PEER_LOST_ERRORS = frozenset({"nixlRemoteDisconnectError"})
"""NIXL exception types that mean the remote agent is gone (by class name:
the classes live in a CUDA-specific binding module)."""


def describe(exc: BaseException) -> str:
    """``Type: message`` (or just the type when the message is empty)."""
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def backend_error(call: str, exc: Exception) -> BackendError:
    """The :class:`BackendError` for NIXL's ``exc`` in ``call``.

    It names the call and NIXL's error; ``peer_lost`` is set for the types in
    :data:`PEER_LOST_ERRORS`. It does not chain ``exc``: NIXL's traceback
    would keep the frames (and the handles in them, which keep the agent
    alive) of the thread that made the call.
    """
    return BackendError(
        f"{call}: {describe(exc)}", peer_lost=type(exc).__name__ in PEER_LOST_ERRORS
    )


@contextlib.contextmanager
def nixl_errors(call: str) -> Iterator[None]:
    """Turn every NIXL exception raised inside into :func:`backend_error`'s error.

    trio_pd's own control-flow exceptions pass through.
    """
    try:
        yield
    except (BackendError, TransferTimeout, BackendClosing, trio.Cancelled):
        raise
    except Exception as exc:
        raise backend_error(call, exc) from exc


def release_or_keep(handle: Any, kept: list[Any]) -> None:
    """Release a transfer handle; one NIXL refuses to release goes to ``kept``
    (released at close), with an error logged."""
    try:
        handle.release()
    except Exception as exc:
        logging.getLogger("trio_pd.nixl").error(
            "transfer handle could not be released (%s); kept until close", describe(exc)
        )
        kept.append(handle)
