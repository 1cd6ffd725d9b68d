"""Which HTTP answer each exception of the serving layer gets: one table.

The engine (:mod:`.app`, :mod:`.engine`, :mod:`.asgi`) and the proxy
(:mod:`.proxy`) turn every exception they catch into their answer through
:data:`ERROR_STATUSES` (:func:`http_error`): status, the error body's
``type``, ``message``, ``param`` and extra keys, and ``Retry-After``. The
docs render the table (``docs/serving.md``, the ``error-statuses``
directive), and ``tests/test_error_statuses.py`` checks that each row is what
the servers answer and that no site picks a status of its own.

Not in the table: refusals that are not an exception caught here but a check
of the request itself -- a field at a value the engine does not take (400
naming it, :mod:`.fields`), an unknown model or path (404), a method (405), a
key (401, :mod:`.keys`), a body too large (413), a draining server (503) --
and the proxy's relay of an engine's own error answer (``prefilling.relayed_error``).
Those raise :class:`HTTPError` where they are checked.
"""

from __future__ import annotations

from typing import Any

import attrs
import httpx2
import trio

from trio_pd._core._errors import (
    ExposureEndedError,
    HandshakeError,
    IncompatibleEngineError,
    ParamsRejectedError,
    TransferError,
)
from trio_pd._serve.pool import OutOfBlocks


class HTTPError(Exception):
    """An error reply: ``status`` and OpenAI's JSON error body,
    ``{"error": {"message", "type", "param", "code", ...extra}}``.

    ``param`` names the request's field at fault; ``code`` is OpenAI's
    machine-readable reason (``"model_not_found"``...), both ``null`` when
    there is none. ``retry_after`` (seconds) becomes a ``Retry-After``
    header (for 503s).
    """

    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {
            "error": {"message": message, "type": kind, "param": param, "code": code, **extra}
        }
        self.headers: list[tuple[bytes, bytes]] = []
        if retry_after is not None:
            self.headers.append((b"retry-after", str(retry_after).encode()))


class BodyNotJSON(ValueError):
    """A request's body is not one JSON document (not UTF-8, malformed, nested
    deeper than Python parses, an integer of more digits than it converts, a
    number that is not finite)."""


class ParamsInUse(ValueError):
    """A decode request's ``kv_transfer_params`` are already held by another
    request on this engine (the same parameters sent twice)."""


class StreamStalled(Exception):
    """A decode engine's answer sent nothing for the proxy's idle deadline."""


class MalformedAnswer(Exception):
    """An engine's answer that the proxy cannot use: a 200 whose body is not
    JSON, or lacks (or mistypes) what the proxy takes from it."""


class DeploymentFault(Exception):
    """A decode engine refused the ``kv_transfer_params`` its prefill engine
    issued -- fields the client never sent (the proxy sets them): the two
    engines disagree (different exposure secrets, say), a deployment fault."""


class ExposureEnded(Exception):
    """A decode engine answered ``exposure_ended`` (its pull found the
    prefill's exposure over) again after the proxy prefilled once more; the
    message is the engine's."""


@attrs.frozen(kw_only=True)
class ErrorStatus:
    """How the servers answer one kind of exception.

    ``message``, ``type`` and ``param`` are :meth:`str.format` templates over
    ``exc`` (the exception), ``cls`` (its class's name) and the keywords the
    site passes to :func:`http_error` (``engine``, ``role``...).

    Attributes:
        status: the HTTP status.
        type: the error body's ``type``.
        message: the error body's ``message``.
        meaning: when it is answered, for the docs (reST inline markup).
        where: the servers that answer it: ``"engine"``, ``"proxy"``.
        param: the error body's ``param``, or ``None``.
        code: the error body's ``code`` (OpenAI's machine-readable reason), or ``None``.
        extra: the site's keywords copied into the error body.
        retry_after: seconds, sent as ``Retry-After``; ``None``: no header.
        counted: the proxy's ``trio_pd_proxy_engine_errors_total`` ``kind``
            it is counted as (``None``: not counted there).
    """

    status: int
    type: str
    message: str
    meaning: str
    where: tuple[str, ...]
    param: str | None = None
    code: str | None = None
    extra: tuple[str, ...] = ()
    retry_after: int | None = None
    counted: str | None = None


_PULL_FAILED = ErrorStatus(
    status=502,
    type="{cls}",
    message="engine {engine}: pulling the KV cache from engine {remote_engine!r} failed: {exc}",
    meaning="the decode engine's pull failed: the handshake with the prefill engine "
    "(``HandshakeError``; ``IncompatibleEngineError``: the producer speaks another "
    "protocol version, has another compatibility key or an incompatible layout) or "
    "the transfer (``TransferError``). ``type`` is the error's class, ``message`` "
    "and ``remote_engine`` name the engine it pulled from, and the cause.",
    where=("engine",),
    extra=("engine", "remote_engine"),
)
_REFUSED = ErrorStatus(
    status=502,
    type="{role}_failed",
    message="{role} engine {engine} failed: {cls}: {exc}",
    meaning="every engine of the role refused the connection, or none was connected "
    "within ``--connect-timeout`` (each was tried in turn; the last one's error). "
    "``engine`` names it.",
    where=("proxy",),
    extra=("engine",),
    counted="refused",
)
_STALLED = ErrorStatus(
    status=504,
    type="{role}_failed",
    message="{role} engine {engine} failed: {cls}: {exc}",
    meaning="writing the request timed out, or a decode engine's answer sent nothing "
    "for ``--idle-timeout``. Not retried. Once a stream has started (its 200 is sent), "
    "the stream ends with this error body as its last event instead.",
    where=("proxy",),
    extra=("engine",),
    counted="timeout",
)

ERROR_STATUSES: dict[type[BaseException], ErrorStatus] = {
    BodyNotJSON: ErrorStatus(
        status=400,
        type="invalid_request_error",
        message="{exc}",
        meaning="the body is not JSON (not UTF-8, malformed, nested too deeply, a number "
        "that is not finite: ``NaN``, ``Infinity``, ``1e999``).",
        where=("engine", "proxy"),
    ),
    ParamsRejectedError: ErrorStatus(
        status=400,
        type="invalid_request_error",
        message="engine {engine}: {exc}",
        meaning="``kv_transfer_params`` that no prefill engine of this deployment issued "
        "(``remote_token``: the engines share an exposure secret), that name remote block "
        "ids out of the producer's range or repeated (``remote_block_ids``, checked once "
        "the handshake is done, before anything is read), or a producer TP size this "
        "engine cannot read from (``tp_size``).",
        where=("engine",),
        param="kv_transfer_params.{exc.field}",
    ),
    ParamsInUse: ErrorStatus(
        status=409,
        type="invalid_request_error",
        message="{exc}",
        meaning="the same ``kv_transfer_params`` are already being decoded on this engine.",
        where=("engine",),
        param="kv_transfer_params",
    ),
    ExposureEndedError: ErrorStatus(
        status=409,
        type="{cls}",
        code="exposure_ended",
        message="engine {engine}: the KV of request {remote_request!r} on engine "
        "{remote_engine!r} is no longer exposed ({exc.outcome}): nothing was decoded, "
        "prefill the request again ({exc.reason})",
        meaning="the decode engine's pull found the prefill's exposure over before or while "
        "it read (``ExposureEndedError``: its lease ran out, it was abandoned or already "
        "read, its engine restarted; ``outcome`` says which). The blocks it read may hold "
        "another request's KV, so nothing is decoded. A 409, not a 503: these "
        "``kv_transfer_params`` will never be readable again, only a new prefill helps "
        "(the proxy does that, once). ``remote_request`` names the prefill's request.",
        where=("engine",),
        extra=("engine", "remote_engine", "remote_request"),
    ),
    HandshakeError: _PULL_FAILED,
    IncompatibleEngineError: _PULL_FAILED,
    TransferError: _PULL_FAILED,
    OutOfBlocks: ErrorStatus(
        status=503,
        type="overloaded",
        message="engine {engine}: {exc}",
        meaning="no KV blocks were freed for the request within ``admission_timeout`` "
        "(10 s). The client may retry.",
        where=("engine",),
        retry_after=1,
    ),
    ExposureEnded: ErrorStatus(
        status=503,
        type="decode_failed",
        code="exposure_ended",
        message="decode engine {engine}: {exc} (after one more prefill)",
        meaning="a decode engine answered ``exposure_ended`` (the 409 above) for the "
        "request prefilled a second time too: the proxy prefills again once, never more. "
        "The client may retry.",
        where=("proxy",),
        extra=("engine",),
        retry_after=1,
        counted="exposure_ended",
    ),
    MalformedAnswer: ErrorStatus(
        status=502,
        type="{role}_failed",
        message="{role} engine {engine} failed: its answer cannot be used: {exc}",
        meaning="an engine answered 200 with a body the proxy cannot use (not JSON, "
        "truncated, a prefill answer without a ``kv_transfer_params`` object). Not retried.",
        where=("proxy",),
        extra=("engine",),
        counted="malformed",
    ),
    DeploymentFault: ErrorStatus(
        status=502,
        type="deployment_error",
        message="decode engine {engine} refused the KV issued by prefill engine "
        "{prefill_engine}: {exc}",
        meaning="a decode engine refused the ``kv_transfer_params`` its prefill engine "
        "issued (a 400 naming one of them, e.g. ``remote_token``): the client never sent "
        "them, so the engines disagree -- different exposure secrets, say. ``engine`` and "
        "``prefill_engine`` name the two; ``/health`` is ``degraded`` while it lasts.",
        where=("proxy",),
        extra=("engine", "prefill_engine"),
        counted="deployment",
    ),
    httpx2.ConnectError: _REFUSED,
    httpx2.ConnectTimeout: _REFUSED,
    trio.TooSlowError: ErrorStatus(
        status=504,
        type="{role}_timeout",
        message="{role} engine {engine}: {phase} within {seconds:g} s",
        meaning="the prefill's answer did not come within ``--prefill-timeout``, or not "
        "even the first byte of the decode's within ``--first-byte-timeout``. Not "
        "retried: the work may have been done.",
        where=("proxy",),
        extra=("engine",),
        counted="timeout",
    ),
    httpx2.TimeoutException: _STALLED,
    StreamStalled: _STALLED,
    httpx2.HTTPError: ErrorStatus(
        status=502,
        type="{role}_failed",
        message="{role} engine {engine} failed: {cls}: {exc}",
        meaning="the connection to the engine broke (or its answer could not be read) "
        "after the request was sent. Not retried; mid-stream, the stream's last event.",
        where=("proxy",),
        extra=("engine",),
        counted="transport",
    ),
    Exception: ErrorStatus(
        status=500,
        type="server_error",
        message="internal error (request {request_id}; logged)",
        meaning="a bug: an exception that escapes a handler is logged with the request id, "
        "and answered in the same JSON shape (the message says no more). No input should "
        "reach it: the request parsers are fuzzed (any JSON value, lone surrogates, huge "
        "integers, deep nesting) to raise nothing but a 4xx; the proxy's handling of "
        "engines' answers is fuzzed (``tests/test_proxy_faults.py``) to reach other rows.",
        where=("engine", "proxy"),
    ),
}
"""Each exception the servers catch, and how they answer it. An exception is
answered by the row of the first class of its MRO that has one; one that
escapes an engine's handler, whatever its class, by ``Exception``'s (a 500)."""


def error_status(exc: BaseException) -> ErrorStatus:
    """The row of ``exc``: that of the first class of its MRO in the table.

    Raises:
        LookupError: no class of ``exc``'s has a row (a ``BaseException``
            that is not an ``Exception``: cancellation, ``KeyboardInterrupt``).
    """
    for cls in type(exc).__mro__:
        row = ERROR_STATUSES.get(cls)
        if row is not None:
            return row
    raise LookupError(f"no row of ERROR_STATUSES for {type(exc).__name__}")


def http_error(
    exc: BaseException, *, row_of: type[BaseException] | None = None, **fields: Any
) -> HTTPError:
    """The answer to ``exc``: its row of :data:`ERROR_STATUSES`, filled in
    (``row_of``'s row instead, when given: the catch-all's ``Exception``).

    ``fields`` are what the row's templates and ``extra`` name (``engine``,
    ``role``, ``remote_engine``...); one that a template names and is missing
    is a ``KeyError`` (a site that does not pass what its row needs).
    """
    row = ERROR_STATUSES[row_of] if row_of is not None else error_status(exc)
    values = {"exc": exc, "cls": type(exc).__name__, **fields}
    return HTTPError(
        row.status,
        row.message.format(**values),
        row.type.format(**values),
        param=row.param.format(**values) if row.param is not None else None,
        code=row.code,
        retry_after=row.retry_after,
        **{name: fields[name] for name in row.extra},
    )
