"""The disaggregation proxy: prefill on one engine, decode on another, on trio.

It plays vLLM's P/D proxy. For each ``POST /v1/completions`` it sends the
request to a prefill engine (round robin) with ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true}``, takes the
``kv_transfer_params`` of the answer, and forwards the original request with
them to a decode engine (round robin), relaying the decode engine's answer --
streamed or not -- to the client.

A client that disconnects cancels its request's scope: the request to the
decode engine is closed, which cancels that engine's pull or decoding (the
prefill engine's exposure is released when read, or expires). An engine that
cannot be reached is skipped for a few seconds and the next one is tried; an
engine that fails fails only the requests it held: the client gets a 502
with a JSON error that names the engine; the proxy goes on with the others.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Sequence
from contextlib import aclosing
from typing import Any

import httpx2
import trio

from .asgi import (
    HTTPError,
    Receive,
    Scope,
    Send,
    cancel_on_disconnect,
    read_json,
    send_event,
    send_json,
)
from .openai import parse_completion_request


class Proxy:
    """Round robin over prefill and decode engines, with one HTTP client.

    Args:
        prefill, decode: the engines' base URLs.
        client: the HTTP client (owned by the caller: close it after the proxy).
        max_model_len: the most tokens (prompt plus ``max_tokens``) every
            engine can hold: longer requests are a 400 before any prefill.
    """

    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        client: httpx2.AsyncClient,
        *,
        max_model_len: int | None = None,
    ):
        if not prefill or not decode:
            raise ValueError("the proxy needs at least one prefill and one decode engine")
        self._max_model_len = max_model_len
        self._prefill_engines = _RoundRobin(prefill)
        self._decode_engines = _RoundRobin(decode)
        self._client = client
        self.accepting = True

    def app(self) -> Callable[[Scope, Receive, Send], Any]:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "lifespan":
                await _trivial_lifespan(receive, send)
                return
            if scope["type"] != "http":
                return
            route = (scope["method"], scope["path"])
            try:
                if route == ("POST", "/v1/completions"):
                    await self._completions(receive, send)
                elif route == ("GET", "/health"):
                    health = {"status": "ok" if self.accepting else "draining"}
                    await send_json(send, 200 if self.accepting else 503, health)
                else:
                    raise HTTPError(404, f"no route {scope['method']} {scope['path']}", "not_found")
            except HTTPError as exc:
                await send_json(send, exc.status, exc.body, exc.headers)

        return app

    async def _completions(self, receive: Receive, send: Send) -> None:
        body = await read_json(receive)
        # A bad request is a 400 here, before any engine does work for it.
        prompt, max_tokens, _, _ = parse_completion_request(body)
        total = len(prompt) + max_tokens
        if self._max_model_len is not None and total > self._max_model_len:
            raise HTTPError(
                400,
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = {total} tokens, "
                f"over the deployment's context of {self._max_model_len}",
                "invalid_request_error",
                param="max_tokens",
            )
        if not self.accepting:
            raise HTTPError(503, "the proxy is draining", "unavailable")
        async with cancel_on_disconnect(receive):
            kv = await self._prefill(body)
            await self._decode({**body, "kv_transfer_params": kv}, send)

    async def _decode(self, body: dict[str, Any], send: Send) -> None:
        """Relay ``body``'s decoding from a decode engine that can be reached.

        One that refuses the connection (it died, say) is skipped for a while
        and the next one is tried: it never saw the request, and the prefill
        engine's exposure is still there for another one to read.
        """
        unreachable: _Unreachable | None = None
        for engine in self._decode_engines.up_to_all():
            try:
                await self._decode_on(engine, body, send)
            except _Unreachable as exc:
                self._decode_engines.down(engine)
                unreachable = exc
                continue
            return
        assert unreachable is not None
        raise unreachable.error

    async def _prefill(self, body: dict[str, Any]) -> dict[str, Any]:
        """The KV of ``body``'s prompt, from a prefill engine that answers.

        An engine that cannot be reached (it died, say) is skipped for a
        while and the next one is tried: the request had not started there.
        """
        request = {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        failure: HTTPError | None = None
        for engine in self._prefill_engines.up_to_all():
            try:
                response = await self._client.post(f"{engine}/v1/completions", json=request)
            except httpx2.TransportError as exc:
                self._prefill_engines.down(engine)
                failure = _engine_failed("prefill", engine, f"{type(exc).__name__}: {exc}")
                continue
            if response.status_code != 200:
                raise _relayed("prefill", engine, response.status_code, response.text)
            kv: dict[str, Any] = response.json()["kv_transfer_params"]
            return kv
        assert failure is not None
        raise failure

    async def _decode_on(self, engine: str, body: dict[str, Any], send: Send) -> None:
        started = False
        try:
            async with self._client.stream(
                "POST", f"{engine}/v1/completions", json=body
            ) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    raise _relayed("decode", engine, response.status_code, text)
                await send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-type", response.headers["content-type"].encode())],
                    }
                )
                started = True
                async with aclosing(response.aiter_raw()) as chunks:
                    async for chunk in chunks:
                        await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b""})
        except httpx2.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, httpx2.ConnectError):
                raise _Unreachable(_engine_failed("decode", engine, reason)) from None
            if not started:
                raise _engine_failed("decode", engine, reason) from None
            # Mid-stream: the status is sent; end the stream with an error event.
            error = _engine_failed("decode", engine, reason)
            await send_event(send, json.dumps(error.body), last=True)


class _Unreachable(Exception):
    """A decode engine refused the connection (``error`` says so, for the client)."""

    def __init__(self, error: HTTPError) -> None:
        super().__init__(str(error))
        self.error = error


class _RoundRobin:
    """Engines in turn, skipping for :data:`DOWN_FOR` s one that could not be reached."""

    DOWN_FOR = 5.0

    def __init__(self, engines: Sequence[str]) -> None:
        self._engines = list(engines)
        self._turn = itertools.count()
        self._down_until: dict[str, float] = {}

    def up_to_all(self) -> list[str]:
        """Every engine once, starting at the next turn, reachable ones first."""
        start = next(self._turn) % len(self._engines)
        order = self._engines[start:] + self._engines[:start]
        now = trio.current_time()
        return sorted(order, key=lambda engine: self._down_until.get(engine, 0.0) > now)

    def down(self, engine: str) -> None:
        self._down_until[engine] = trio.current_time() + self.DOWN_FOR


def _relayed(role: str, engine: str, status: int, text: str) -> HTTPError:
    """An engine's error answer, for the client.

    A 4xx is the request's fault: relayed as is (the engine named). A 503
    (the engine is overloaded or draining) stays a 503 with ``Retry-After``:
    the client may retry. Anything else is the engine failing: a 502.
    """
    try:
        error = json.loads(text)["error"]
        message = str(error["message"])
    except (ValueError, KeyError, TypeError):
        error, message = {}, text
    if 400 <= status < 500 or status == 503:
        extra = {k: v for k, v in error.items() if k not in ("message", "type")}
        return HTTPError(
            status,
            f"{role} engine {engine}: {message}",
            str(error.get("type", f"{role}_failed")),
            retry_after=1 if status == 503 else None,
            **{"engine": engine, **extra},
        )
    return _engine_failed(role, engine, f"{status} {message}")


def _engine_failed(role: str, engine: str, reason: str) -> HTTPError:
    return HTTPError(
        502, f"{role} engine {engine} failed: {reason}", f"{role}_failed", engine=engine
    )


async def _trivial_lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
        else:  # pragma: no cover
            await trio.lowlevel.checkpoint()
