"""Concurrent dispatch: a decode request sent with its prefill, its parameters a second line.

With ``--dispatch concurrent`` (not the default: :data:`.proxy.DISPATCH`) the proxy sends the
decode request at the same time as the prefill request, as SGLang's P/D
router does, and its ``kv_transfer_params`` follow once the prefill engine
answered, as a second line of the same streamed request body. The
connection, the request's sending, parsing and checks happen while the
prefill runs; the parameters' arrival starts the decode engine's hold,
admission and pull at once. (It takes no KV blocks before: see
:meth:`~.engine.Engine.generation` for the deadlock that would risk.)

The wire shape (a decode request; the proxy is its only sender):

* the header ``X-Trio-PD-Params-Within: SECONDS`` says that the body is two
  lines and how long the engine waits for the second (what the proxy gives
  its prefill, and a second more);
* line 1: the request's JSON object, without ``kv_transfer_params``, then
  ``\\n``;
* line 2: ``{"kv_transfer_params": {...}}`` (the prefill engine's answer,
  ``do_remote_prefill`` true), then ``\\n``; then the body ends.

Each line is one JSON document in UTF-8 with no newline byte in it
(``json.dumps`` escapes every control character in strings; no byte of a
multi-byte character is ASCII). A prefill that fails ends the
request: the proxy closes the decode request's connection, which cancels
it on the decode engine (what it admitted goes back to its pool). An engine
that refuses the request (a bad field, draining, no free blocks in time)
still reads the second line before it answers, and gives the exposure back
at once, as it does the parameters of a refused one-line request -- also
when the body itself is refused (a malformed first line, a third line),
wherever its second line names an exposure.

The engine's side is :class:`SecondLine`; the proxy's is
:func:`first_line` and :func:`second_line`. No I/O here beyond the request's
own ``receive``.
"""

from __future__ import annotations

import json
import math
from typing import Any

import trio

from trio_pd._serve.asgi import Receive, parse_json
from trio_pd._serve.errors import BodyNotJSON, HTTPError, http_error

PARAMS_WITHIN_HEADER = "x-trio-pd-params-within"
"""The request header of a decode request whose ``kv_transfer_params`` follow
as the body's second line: how long (seconds) the engine waits for them."""

MOST_PARAMS_WITHIN = 3600.0
"""The longest a decode engine waits for a second line, whatever the header says."""

KV_PARAMS = "kv_transfer_params"
BODY_LIMIT = 1 << 20
"""The most bytes of a request's body (both lines), as for a one-line body."""


def params_within(headers: Any) -> float | None:
    """The seconds that a request's ``X-Trio-PD-Params-Within`` header gives
    its second line (at most :data:`MOST_PARAMS_WITHIN`), or ``None`` if it has
    no such header (its body is one JSON object).

    Raises:
        HTTPError: the header is not a positive number of seconds (400).
    """
    for name, value in headers:
        if name.lower() == PARAMS_WITHIN_HEADER.encode():
            try:
                seconds = float(value.decode("ascii"))
            except (UnicodeDecodeError, ValueError):
                seconds = math.nan
            if not (seconds > 0 and math.isfinite(seconds)):
                raise HTTPError(
                    400,
                    f"{PARAMS_WITHIN_HEADER} must be a positive number of seconds",
                    "invalid_request_error",
                )
            return min(seconds, MOST_PARAMS_WITHIN)
    return None


def has_second_line(headers: Any) -> bool:
    """Whether a request's headers say its parameters follow as a second line
    (an ``X-Trio-PD-Params-Within`` header, well-formed or not: only the
    request's own reader, :class:`SecondLine`, may take that line)."""
    name = PARAMS_WITHIN_HEADER.encode()
    return any(key.lower() == name for key, _ in headers)


def first_line(body: dict[str, Any]) -> bytes:
    """The proxy's line 1: ``body`` (its own ``kv_transfer_params`` left out)."""
    return _line({key: value for key, value in body.items() if key != KV_PARAMS})


def second_line(kv: dict[str, Any]) -> bytes:
    """The proxy's line 2: a prefill engine's ``kv_transfer_params``."""
    return _line({KV_PARAMS: kv})


def _line(data: dict[str, Any]) -> bytes:
    # UTF-8, as the proxy's HTTP client encodes a JSON body (so that the line
    # is no longer than the prefill request's body: escaping every non-ASCII
    # character took up to 6 bytes for 2, and a body under BODY_LIMIT went
    # over it). No byte of the line is a newline but its last: json.dumps
    # escapes every control character in strings, and no byte of a multi-byte
    # UTF-8 sequence is below 0x80. (The proxy checked the body: no lone
    # surrogates, no non-finite numbers.)
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return text.encode() + b"\n"


_UNREAD = object()
"""(line 2 not read yet: ``null`` is a line too)"""


class SecondLine:
    """A decode engine's reader of a two-line body (see the module docstring).

    :meth:`first` reads line 1; :meth:`params` line 2, once the proxy sends
    it, until ``within`` seconds after this reader was made. Reading may be
    cancelled and resumed (no byte is lost); a failure is kept and raised
    again. :attr:`read` is set once line 2 was read whole: from then on the
    request's ``receive`` is free for a disconnect watcher (which also takes
    the body's end). :attr:`named` is what line 2 names, once read, even
    where :meth:`params` refused the body: an exposure to give back.
    """

    def __init__(self, receive: Receive, within: float) -> None:
        self._receive = receive
        self._buffer = bytearray()
        self._ended = False  # (the last body message arrived)
        self._failure: HTTPError | None = None
        self._second: object = _UNREAD  # (line 2, parsed)
        self.within = within
        self.deadline = trio.current_time() + within
        self.value: dict[str, Any] | None = None  # (line 2's kv_transfer_params, once read)
        # (the kv_transfer_params object that line 2 names, even where the body
        # is refused -- a third line, another field beside them --: an
        # exposure to give back)
        self.named: dict[str, Any] | None = None
        self.read = trio.Event()

    async def first(self) -> dict[str, Any]:
        """Line 1, a JSON object.

        Raises:
            HTTPError: 400 (not a JSON object, or it has ``kv_transfer_params``),
                408 (not within the deadline), 413, 499 (the proxy went away).
        """
        data = _parsed(await self._line("the request"), "the body's first line")
        if not isinstance(data, dict):
            raise HTTPError(
                400, "the body's first line must be a JSON object", "invalid_request_error"
            )
        if KV_PARAMS in data:
            raise HTTPError(
                400,
                f"{KV_PARAMS} come on the body's second line ({PARAMS_WITHIN_HEADER} is set)",
                "invalid_request_error",
                param=KV_PARAMS,
            )
        return data

    async def params(self, *, whole: bool = True) -> dict[str, Any]:
        """Line 2's ``kv_transfer_params`` (checked as an object that asks for a
        remote prefill; :func:`~.openai.parse_remote_blocks` checks the rest),
        once the body ended too (``whole``; a refusal that only needs what
        line 2 names does not wait for the end).

        Raises:
            HTTPError: 400 (malformed, more than two lines, or the body ended
                without it), 408 (not within ``within`` s), 413, 499.
        """
        if self.value is not None:
            return self.value
        if self._failure is not None:
            raise self._failure
        try:
            if self._second is _UNREAD:  # (a read cancelled while the body ends: kept)
                self._second = _parsed(await self._line(KV_PARAMS), "the body's second line")
            data = self._second
            named = data.get(KV_PARAMS) if isinstance(data, dict) else None
            self.named = named if isinstance(named, dict) else None
            if self._buffer:
                raise HTTPError(400, "the body has more than two lines", "invalid_request_error")
            kv = named if isinstance(data, dict) and len(data) == 1 else None
            if not isinstance(kv, dict):
                raise HTTPError(
                    400,
                    f'the body\'s second line must be {{"{KV_PARAMS}": {{...}}}} and nothing else',
                    "invalid_request_error",
                    param=KV_PARAMS,
                )
            if kv.get("do_remote_prefill") is not True:
                raise HTTPError(
                    400,
                    f"the second line's {KV_PARAMS} must ask for a remote prefill "
                    "(do_remote_prefill: true)",
                    "invalid_request_error",
                    param=f"{KV_PARAMS}.do_remote_prefill",
                )
            if whole:
                await self._end()
                if self._buffer:
                    raise HTTPError(
                        400, "the body has more than two lines", "invalid_request_error"
                    )
        except HTTPError as exc:
            self._failure = exc
            raise
        self.value = kv
        self.read.set()
        return kv

    async def _receive_part(self) -> None:
        """The body's next part, into the buffer.

        Raises:
            HTTPError: 499 (the proxy went away), 413 (over :data:`BODY_LIMIT`).
        """
        message = await self._receive()
        if message["type"] == "http.disconnect":
            raise HTTPError(499, "the client went away", "disconnect")
        self._buffer += message.get("body", b"")
        self._ended = not message.get("more_body")
        if len(self._buffer) > BODY_LIMIT:
            raise HTTPError(413, f"request body over {BODY_LIMIT} bytes", "invalid_request_error")

    async def _end(self) -> None:
        """Read the body to its end (it ends right after line 2).

        So that the request is whole before its answer can end: a server
        that closes a connection whose body is still arriving makes the
        kernel reset it, and the client can lose the end of the answer
        (seen with answers that end within a millisecond of line 2).
        """
        with trio.move_on_at(self.deadline):
            while not self._ended:
                await self._receive_part()
            return
        raise HTTPError(
            408,
            f"the request's body did not end within {self.within:g} s of its start "
            f"({PARAMS_WITHIN_HEADER})",
            "invalid_request_error",
            code="params_timeout",
        )

    async def _line(self, what: str) -> bytes:
        """The next line of the body (without its newline)."""
        with trio.move_on_at(self.deadline):
            scanned = 0  # (each byte is looked at once: a line sent a byte at a time is O(n))
            while (end := self._buffer.find(b"\n", scanned)) < 0:
                scanned = len(self._buffer)
                if self._ended:
                    raise HTTPError(
                        400,
                        f"the body ended before its {what} line "
                        f"({PARAMS_WITHIN_HEADER}: two lines, each ending in a newline)",
                        "invalid_request_error",
                    )
                await self._receive_part()
            line = bytes(self._buffer[:end])
            del self._buffer[: end + 1]
            return line
        raise HTTPError(
            408,
            f"the request's {what} line did not arrive within {self.within:g} s "
            f"({PARAMS_WITHIN_HEADER})",
            "invalid_request_error",
            code="params_timeout",
        )


def _parsed(line: bytes, where: str) -> object:
    try:
        return parse_json(line)
    except ValueError as exc:
        raise http_error(BodyNotJSON(f"{where} is not JSON: {exc}")) from None
    except RecursionError:
        raise http_error(BodyNotJSON(f"{where} is nested too deeply")) from None
