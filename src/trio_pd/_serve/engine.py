"""An engine server: the tiny model, its paged KV cache, its connectors, HTTP on trio.

Each engine is a process running hypercorn's trio worker. Its connector --
one per tensor-parallel rank: rank ``r`` registers its head slice of the KV
cache and listens on the base port + ``r`` -- is opened in the ASGI
*lifespan*, so it lives exactly as long as the server accepts requests:
requests run while it is open, and it closes (releasing NIXL and ZeroMQ)
after the last one drained. (The ranks share this process: the model
computes for all of them; their KV caches and connectors are separate, as on
a real tensor-parallel engine.)

``POST /v1/completions`` follows OpenAI's completions API and vLLM's P/D
conventions (``kv_transfer_params``):

* ``{"do_remote_decode": true}``: prefill only. The engine computes the
  prompt's KV cache (all but its last token) into blocks, exposes them, and
  answers with ``kv_transfer_params`` that a decode engine pulls with. The
  blocks return to the pool when the decode engine has read them (or the
  exposure expired).
* ``{"do_remote_prefill": true, ...}`` (what a prefill engine returned): the
  engine pulls those blocks over NIXL, then decodes from the prompt's last
  token.
* neither: the engine runs the whole request itself.

Both paths run the same model steps, so disaggregated output equals
single-engine output token for token (see :mod:`trio_pd._serve.model`).

``GET /health`` says whether the engine accepts requests; ``GET /metrics``
is Prometheus text (the connector's statistics, requests, pull latency).
"""

from __future__ import annotations

import argparse
import codecs
import collections
import contextlib
import functools
import itertools
import json
import logging
import math
import os
import signal
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, aclosing, asynccontextmanager
from typing import Any

import attrs
import torch
import trio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .._config import ConnectorConfig
from .._connector import Connector, open_connector
from .._errors import HandshakeError, ParamsRejectedError, TransferError
from .._groups import unwrapped_errors
from .._records import RemoteBlocks
from ..testing import free_port_range
from .asgi import (
    HTTPError,
    Receive,
    Scope,
    Send,
    cancel_on_disconnect,
    read_json,
    send_event,
    send_json,
    send_text,
    start_events,
)
from .model import ModelConfig, TinyLlama, tokenize

logger = logging.getLogger("trio_pd.serve")

MODEL_NAME = "trio-pd-tiny"
MAX_TOKENS = 1024
MAX_MODEL_LEN = 2048
"""Prompt plus generated tokens (bytes): attention is quadratic in it."""


@attrs.frozen
class EngineSettings:
    """One engine's settings (the CLI passes them to the engine process as JSON)."""

    engine_id: str
    http_port: int
    side_channel_port: int = 0
    host: str = "127.0.0.1"
    num_blocks: int = 1024
    abort_timeout: float = 30.0
    ready_file: str = ""  # written with {"url": ...} once the engine accepts requests
    tp_size: int = 1
    max_model_len: int = MAX_MODEL_LEN
    admission_timeout: float = 10.0  # how long a request waits for free KV blocks
    # Exposures: held 5 s unless the decode engine holds them (it renews every
    # second while the request waits for its blocks), 30 s at most.
    lease_initial: float = 5.0
    lease_renewal: float = 3.0
    heartbeat_interval: float = 1.0


EXPOSURE_SECRET_ENV = "TRIO_PD_EXPOSURE_SECRET"
"""The environment variable that hands an engine its deployment's exposure
secret (hex): not on the command line, where ``ps`` shows it."""


class OutOfBlocks(Exception):
    """The KV-cache pool did not have enough free blocks in time."""


@attrs.define(eq=False)
class _Turn:
    """A request waiting for blocks; ``blocks`` are set aside for it when granted."""

    count: int
    granted: trio.Event = attrs.field(factory=trio.Event)
    blocks: list[int] = attrs.field(factory=list)


class BlockPool:
    """The free KV-cache blocks of an engine, handed out first come, first served.

    Trio thread only. A request that needs more blocks than are free waits
    (in order: a large request is not starved by small ones) until enough
    are released or its deadline passes. Blocks are set aside for a waiter
    when it is granted, so nobody takes them before it runs.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._waiters: collections.deque[_Turn] = collections.deque()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def allocate(self, count: int, *, deadline: float) -> list[int]:
        """``count`` blocks, waiting until ``deadline`` (trio's clock) for them.

        Raises:
            ValueError: ``count`` is more than the whole pool.
            OutOfBlocks: not enough were free by ``deadline``.
        """
        if count > self.num_blocks:
            raise ValueError(f"{count} KV blocks needed, the pool has {self.num_blocks}")
        turn = _Turn(count)
        self._waiters.append(turn)
        self._grant()
        try:
            with trio.move_on_at(deadline):
                await turn.granted.wait()
        except BaseException:  # cancelled (the client left): give back or step out
            self._withdraw(turn)
            raise
        if not turn.granted.is_set():
            self._withdraw(turn)
            raise OutOfBlocks(
                f"{count} KV blocks needed, {len(self._free)} free after waiting "
                f"({len(self._waiters)} requests still waiting)"
            )
        return turn.blocks

    def release(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)
        self._grant()

    def _withdraw(self, turn: _Turn) -> None:
        if turn.granted.is_set():
            self.release(turn.blocks)
        else:
            self._waiters.remove(turn)
            self._grant()  # (the next one may fit now)

    def _grant(self) -> None:
        """Set blocks aside for the waiters at the head of the line, in order."""
        while self._waiters and self._waiters[0].count <= len(self._free):
            turn = self._waiters.popleft()
            taken = self._free[len(self._free) - turn.count :]
            del self._free[len(self._free) - turn.count :]
            turn.blocks = taken[::-1]
            turn.granted.set()


class Engine:
    """The model, its cache and block pool, and the requests on them.

    Owns the KV cache tensors (registered with the connector), the block
    pool, and the tasks that give exposed blocks back to the pool
    (``nursery``, the server's). Forwards run in a worker thread, one at a
    time (``compute``), so the trio loop stays free for I/O.
    """

    def __init__(self, settings: EngineSettings, model: TinyLlama) -> None:
        self.settings = settings
        self.model = model
        self.cache = model.new_cache(settings.num_blocks, settings.tp_size)
        self.pool = BlockPool(settings.num_blocks)
        self.compute = trio.CapacityLimiter(1)
        self.connectors: list[Connector] = []  # one per rank, while serving
        self.nursery: trio.Nursery | None = None
        self.accepting = False
        self._ids = itertools.count()
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "trio_pd_serve_requests",
            "Completion requests by kind and outcome.",
            ["kind", "outcome"],
            registry=self.registry,
        )
        self.pull_seconds = Histogram(
            "trio_pd_serve_pull_seconds",
            "Time of each KV pull (handshake included), decode side.",
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5, 1, 5, math.inf),
        )
        free = Gauge(
            "trio_pd_serve_kv_blocks_free",
            "KV-cache blocks free in the engine's pool.",
            registry=self.registry,
        )
        free.set_function(lambda: self.pool.free)
        self.registry.register(_ConnectorCollector(lambda: self.connectors))

    def request_id(self) -> str:
        return f"cmpl-{self.settings.engine_id}-{next(self._ids)}"

    async def step(self, table: Sequence[int], tokens: Sequence[int], start: int) -> int:
        return await trio.to_thread.run_sync(
            self.model.forward, self.cache, table, tokens, start, limiter=self.compute
        )

    def admission_deadline(self) -> float:
        return trio.current_time() + self.settings.admission_timeout

    def check_fits(self, prompt: list[int], max_tokens: int) -> None:
        """A 400 for a request that could never run here, before any work.

        Raises:
            HTTPError: prompt plus ``max_tokens`` is over ``max_model_len``, or
                needs more KV blocks than the whole pool has.
        """
        total = len(prompt) + max_tokens
        if total > self.settings.max_model_len:
            raise HTTPError(
                400,
                f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) = {total} tokens, "
                f"over this model's context of {self.settings.max_model_len}",
                "invalid_request_error",
                param="max_tokens",
            )
        needed = self.model.config.blocks_for(total)
        if needed > self.pool.num_blocks:
            raise HTTPError(
                400,
                f"the request needs {needed} KV blocks; engine {self.settings.engine_id} has "
                f"{self.pool.num_blocks} in all: it can never run here",
                "invalid_request_error",
                param="max_tokens",
            )

    async def prefill_for_remote(self, request_id: str, prompt: list[int]) -> dict[str, Any]:
        """Compute the prompt's KV (all but the last token) and expose its blocks.

        The blocks go back to the pool once every rank's exposure resolved
        (read, abandoned or expired).

        Raises:
            OutOfBlocks: not enough blocks freed within ``admission_timeout``.
        """
        connectors = self._connectors()
        self.check_fits(prompt, 1)
        blocks = await self.pool.allocate(
            self.model.config.blocks_for(len(prompt) - 1), deadline=self.admission_deadline()
        )
        try:
            if len(prompt) > 1:
                await self.step(blocks, prompt[:-1], 0)
            # Every rank exposes its head slice; rank 0's parameters go to the
            # decode engine (they name the base port and the TP size).
            exposed = [connector.expose(request_id, blocks) for connector in connectors]
            remote = exposed[0]
        except BaseException:
            self.pool.release(blocks)
            raise
        assert self.nursery is not None
        self.nursery.start_soon(self._release_when_released, connectors, request_id, blocks)
        return {**remote.to_kv_transfer_params(), "do_remote_prefill": True}

    async def _release_when_released(
        self, connectors: list[Connector], request_id: str, blocks: list[int]
    ) -> None:
        """Give ``blocks`` back once every rank's exposure of ``request_id`` resolved.

        The ranks are waited on together: waited one after another, a
        rank's outcome could leave its bounded history while an earlier rank
        was still pending (a ``KeyError`` then). Cancelled at shutdown, when
        the connectors close and the pool goes with them.
        """

        async def released(connector: Connector) -> None:
            with contextlib.suppress(KeyError):  # (resolved long ago: forgotten)
                await connector.wait_released(request_id)

        try:
            async with trio.open_nursery() as nursery:
                for connector in connectors:
                    nursery.start_soon(released, connector)
        finally:
            self.pool.release(blocks)

    @asynccontextmanager
    async def generation(
        self, request_id: str, prompt: list[int], max_tokens: int, params: dict[str, Any] | None
    ) -> AsyncIterator[AsyncGenerator[int, None]]:
        """Blocks for the whole request, the prompt's KV in them, and a token iterator.

        With ``params`` (from a prefill engine) the prompt's KV is pulled;
        without, computed here. Waits up to ``admission_timeout`` for free
        blocks; meanwhile every rank *holds* the prefill's blocks (renewing
        their lease), and if the request fails or is cancelled before its
        pull, leaving the hold gives them back to the prefill engine at once.
        The blocks go back to the pool when the block exits --
        unless a transfer that could not be stopped may still write them
        (``Connector.unsettled_blocks``, whichever way the pull ended): then
        only once it has settled.

        Raises:
            HandshakeError, TransferError: the pull failed.
            ParamsRejectedError: ``params`` claim what the producer did not issue.
            HTTPError: ``params`` are malformed or do not match the prompt.
            OutOfBlocks: not enough blocks freed within ``admission_timeout``.
        """
        config = self.model.config
        before = len(prompt) - 1
        remote: RemoteBlocks | None = None
        if params is not None:
            remote = parse_remote_blocks(params)
        connectors = self._connectors()
        blocks: list[int] | None = None
        try:
            async with AsyncExitStack() as holds:
                if remote is not None:
                    # Every rank holds the prefill's blocks until its pull: the
                    # producer keeps them however long admission takes, and
                    # frees them at once if this request fails or its client
                    # leaves before the pull (leaving a hold abandons it).
                    for connector in connectors:
                        try:
                            await holds.enter_async_context(connector.hold(remote))
                        except ValueError as exc:  # (the same parameters in two requests)
                            raise HTTPError(
                                409, str(exc), "invalid_request_error", param="kv_transfer_params"
                            ) from None
                if remote is not None:
                    check_prompt_blocks(remote, config.blocks_for(before), len(prompt))
                self.check_fits(prompt, max_tokens)
                blocks = await self.pool.allocate(
                    config.blocks_for(len(prompt) + max_tokens), deadline=self.admission_deadline()
                )
                if remote is not None:
                    started = time.monotonic()
                    into = blocks[: len(remote.block_ids)]
                    await _pull_every_rank(connectors, request_id, into, remote)
                    self.pull_seconds.observe(time.monotonic() - started)
                elif before > 0:
                    await self.step(blocks, prompt[:-1], 0)
            yield self._tokens(blocks, prompt, max_tokens)
        finally:
            if blocks is not None:
                self._release_when_settled(connectors, blocks)

    def _release_when_settled(self, connectors: list[Connector], blocks: list[int]) -> None:
        """Give ``blocks`` back now, or -- if a transfer may still write one of
        them -- once every rank's transfers into them have settled."""
        if all(connector.unsettled_blocks().isdisjoint(blocks) for connector in connectors):
            self.pool.release(blocks)
            return
        logger.warning(
            "engine %s: %d KV blocks kept out of the pool until a transfer that could not "
            "be stopped ends",
            self.settings.engine_id,
            len(blocks),
        )

        async def when_settled() -> None:
            for connector in connectors:
                await connector.wait_settled(blocks)
            self.pool.release(blocks)

        assert self.nursery is not None
        self.nursery.start_soon(when_settled)

    async def _tokens(
        self, blocks: list[int], prompt: list[int], max_tokens: int
    ) -> AsyncGenerator[int, None]:
        token, position = prompt[-1], len(prompt) - 1
        for _ in range(max_tokens):
            token = await self.step(blocks, [token], position)
            position += 1
            yield token

    def _connectors(self) -> list[Connector]:
        if not self.connectors:
            raise HTTPError(503, "the engine is not serving", "unavailable")
        return self.connectors


async def _pull_every_rank(
    connectors: list[Connector], request_id: str, blocks: list[int], remote: RemoteBlocks
) -> None:
    """Each rank pulls its head slice (from the prefill ranks that hold it), at once.

    The first failure cancels the others (a cancelled pull still lets its
    running transfer end first) and propagates alone.
    """
    if len(connectors) == 1:
        await connectors[0].pull(request_id, blocks, remote)
        return
    async with unwrapped_errors(), trio.open_nursery() as nursery:
        for connector in connectors:
            nursery.start_soon(connector.pull, request_id, blocks, remote)


class _ConnectorCollector:
    """The connectors' statistics as Prometheus metrics (summed over the ranks),
    read at each scrape."""

    GAUGES = frozenset(
        {
            "engines_ready",
            "pulls_in_flight",
            "remote_agents_loaded",
            "exposures_pending",
            "transfers_unsettled",
            "blocks_unsettled",
            "holds_active",
        }
    )

    def __init__(self, connectors: Callable[[], list[Connector]]) -> None:
        self._connectors = connectors

    def collect(self) -> list[Metric]:
        connectors = self._connectors()
        if not connectors:
            return []
        stats = [
            {
                name: value
                for name, value in attrs.asdict(c.statistics(), recurse=False).items()
                if not isinstance(value, str)  # (backend_stuck_call: /health says it)
            }
            for c in connectors
        ]
        out: list[Metric] = []
        causes = CounterMetricFamily(
            "trio_pd_handshake_failures_by_cause",
            "Failed handshakes by cause.",
            labels=["cause"],
        )
        by_cause: dict[str, int] = {}
        for rank in stats:
            for cause, count in rank.pop("handshake_failures_by_cause").items():
                by_cause[cause] = by_cause.get(cause, 0) + count
        for cause, count in by_cause.items():
            causes.add_metric([cause], count)
        out.append(causes)
        for name in stats[0]:
            value = sum(rank[name] for rank in stats)
            doc = f"trio_pd ConnectorStatistics.{name}, summed over the ranks"
            if name in self.GAUGES:
                out.append(GaugeMetricFamily(f"trio_pd_{name}", doc, value=value))
            else:
                out.append(CounterMetricFamily(f"trio_pd_{name}", doc, value=value))
        return out


def completion(
    request_id: str, text: str, token_ids: list[int], prompt_tokens: int, **extra: Any
) -> dict[str, Any]:
    """An OpenAI completions response body (``token_ids``: vLLM's addition)."""
    return {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [
            {
                "index": 0,
                "text": text,
                "token_ids": token_ids,
                "logprobs": None,
                "finish_reason": "length",
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(token_ids),
            "total_tokens": prompt_tokens + len(token_ids),
        },
        **extra,
    }


def exposure_secret_from_env() -> bytes | None:
    """The deployment's exposure secret from :data:`EXPOSURE_SECRET_ENV` (``None`` if unset).

    Raises:
        ValueError: it is set but not hex, or shorter than 16 bytes.
    """
    text = os.environ.get(EXPOSURE_SECRET_ENV, "")
    if not text:
        return None
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{EXPOSURE_SECRET_ENV} must be hex") from None
    if len(secret) < 16:
        raise ValueError(f"{EXPOSURE_SECRET_ENV} must hold at least 16 bytes")
    return secret


def parse_remote_blocks(params: dict[str, Any]) -> RemoteBlocks:
    """The decode request's ``kv_transfer_params`` as :class:`RemoteBlocks`, or a 400."""
    try:
        return RemoteBlocks.from_kv_transfer_params(params)
    except ValueError as exc:
        raise HTTPError(
            400, str(exc), "invalid_request_error", param="kv_transfer_params"
        ) from None


def check_prompt_blocks(remote: RemoteBlocks, blocks: int, prompt_tokens: int) -> None:
    """A 400 unless ``remote`` holds the ``blocks`` that the prompt's KV fills."""
    if len(remote.block_ids) != blocks:
        raise HTTPError(
            400,
            f"kv_transfer_params hold {len(remote.block_ids)} blocks, a prompt of "
            f"{prompt_tokens} tokens needs {blocks}",
            "invalid_request_error",
            param="kv_transfer_params.remote_block_ids",
        )


def parse_completion_request(body: dict[str, Any]) -> tuple[list[int], int, bool, dict[str, Any]]:
    """``(prompt tokens, max_tokens, stream, kv_transfer_params)``, or a 400."""
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise HTTPError(400, "prompt must be a non-empty string", "invalid_request_error")
    try:
        prompt.encode()
    except UnicodeEncodeError as exc:  # a lone surrogate ("\ud800" in the JSON)
        raise HTTPError(
            400, f"prompt is not valid Unicode: {exc.reason}", "invalid_request_error"
        ) from None
    max_tokens = body.get("max_tokens", 16)
    if (
        not isinstance(max_tokens, int)
        or isinstance(max_tokens, bool)
        or not (1 <= max_tokens <= MAX_TOKENS)
    ):
        raise HTTPError(
            400, f"max_tokens must be an int in [1, {MAX_TOKENS}]", "invalid_request_error"
        )
    if body.get("temperature", 0) not in (0, 0.0):
        raise HTTPError(400, "only temperature 0 (greedy) is supported", "invalid_request_error")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HTTPError(400, "stream must be true or false", "invalid_request_error")
    params = body.get("kv_transfer_params") or {}
    if not isinstance(params, dict):
        raise HTTPError(400, "kv_transfer_params must be an object", "invalid_request_error")
    return tokenize(prompt), max_tokens, stream, params


def build_app(engine: Engine) -> Callable[[Scope, Receive, Send], Any]:
    """The engine's ASGI application (lifespan: the connectors)."""

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(engine, receive, send)
            return
        if scope["type"] != "http":
            return
        route = (scope["method"], scope["path"])
        try:
            if route == ("POST", "/v1/completions"):
                await _completions(engine, receive, send)
            elif route == ("GET", "/health"):
                await _health(engine, send)
            elif route == ("GET", "/metrics"):
                text = generate_latest(engine.registry).decode()
                await send_text(send, 200, text, "text/plain; version=0.0.4")
            else:
                raise HTTPError(404, f"no route {scope['method']} {scope['path']}", "not_found")
        except HTTPError as exc:
            await send_json(send, exc.status, exc.body, exc.headers)

    return app


async def _health(engine: Engine, send: Send) -> None:
    """200 while the engine serves; 503 draining, or while NIXL is stuck in a load."""
    stuck = [c.statistics().backend_stuck_call for c in engine.connectors]
    stuck = [call for call in stuck if call]
    health: dict[str, Any] = {"pid": os.getpid()}
    if stuck:
        health.update(status="stuck", stuck_call=stuck[0])
    elif engine.accepting and engine.connectors:
        health.update(status="ok")
    else:
        health.update(status="draining")
    await send_json(send, 200 if health["status"] == "ok" else 503, health)


async def _lifespan(engine: Engine, receive: Receive, send: Send) -> None:
    """Open the connectors for the server's life; close them after the last request.

    Inside it, a nursery holds the tasks that give exposed blocks back to the
    pool; at shutdown (hypercorn sends it once every request has drained)
    they are cancelled first, then the connectors close.
    """
    message = await receive()
    assert message["type"] == "lifespan.startup"
    settings = engine.settings
    started = False
    base_port = settings.side_channel_port
    if settings.tp_size > 1 and not base_port:
        base_port = free_port_range(settings.tp_size, settings.host)
    try:
        async with AsyncExitStack() as stack:
            connectors = [
                await stack.enter_async_context(
                    open_connector(
                        settings.engine_id,
                        regions,
                        host=settings.host,
                        port=base_port,
                        config=ConnectorConfig(
                            abort_timeout=settings.abort_timeout,
                            lease_initial=settings.lease_initial,
                            lease_renewal=settings.lease_renewal,
                            heartbeat_interval=settings.heartbeat_interval,
                            exposure_secret=exposure_secret_from_env(),
                        ),
                        tp_rank=rank,
                        tp_size=settings.tp_size,
                    )
                )
                for rank, regions in enumerate(engine.cache)
            ]
            nursery = await stack.enter_async_context(trio.open_nursery())
            engine.connectors, engine.nursery, engine.accepting = connectors, nursery, True
            await send({"type": "lifespan.startup.complete"})
            started = True
            await receive()  # lifespan.shutdown
            engine.accepting = False
            engine.connectors = []
            nursery.cancel_scope.cancel()
    except Exception as exc:
        logger.exception("engine %s: the connector failed", settings.engine_id)
        if not started:
            await send({"type": "lifespan.startup.failed", "message": str(exc)})
            return
        await send({"type": "lifespan.shutdown.failed", "message": str(exc)})
        return
    await send({"type": "lifespan.shutdown.complete"})


async def _completions(engine: Engine, receive: Receive, send: Send) -> None:
    body = await read_json(receive)
    prompt, max_tokens, stream, params = parse_completion_request(body)
    if not engine.accepting:
        raise HTTPError(503, "the engine is draining", "unavailable", retry_after=1)
    request_id = engine.request_id()
    if params.get("do_remote_decode"):
        kind = "prefill"
    elif params.get("do_remote_prefill"):
        kind = "decode"
    else:
        kind = "whole"
    outcome, answered = "error", False

    async def send_tracked(message: dict[str, Any]) -> None:
        nonlocal answered
        if message["type"] == "http.response.body" and not message.get("more_body"):
            answered = True  # (the client may disconnect right after: still answered)
        await send(message)

    try:
        async with cancel_on_disconnect(receive):
            if kind == "prefill":
                kv = await engine.prefill_for_remote(request_id, prompt)
                body = completion(request_id, "", [], len(prompt), kv_transfer_params=kv)
                await send_json(send_tracked, 200, body)
            else:
                await _generate(
                    engine, send_tracked, request_id, prompt, max_tokens, stream, kind, params
                )
        outcome = "ok" if answered else "disconnected"
    except OutOfBlocks as exc:
        raise HTTPError(
            503, f"engine {engine.settings.engine_id}: {exc}", "overloaded", retry_after=1
        ) from None
    except ParamsRejectedError as exc:
        raise HTTPError(
            400,
            f"engine {engine.settings.engine_id}: {exc}",
            "invalid_request_error",
            param=f"kv_transfer_params.{exc.field}",
        ) from None
    except (HandshakeError, TransferError) as exc:
        source = params.get("remote_engine_id")
        raise HTTPError(
            502,
            f"engine {engine.settings.engine_id}: pulling the KV cache from engine "
            f"{source!r} failed: {exc}",
            type(exc).__name__,
            engine=engine.settings.engine_id,
            remote_engine=source,
        ) from None
    finally:
        engine.requests.labels(kind, outcome).inc()


async def _generate(
    engine: Engine,
    send: Send,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    stream: bool,
    kind: str,
    params: dict[str, Any],
) -> None:
    remote = params if kind == "decode" else None
    async with (
        engine.generation(request_id, prompt, max_tokens, remote) as generator,
        aclosing(generator) as tokens,  # (closed even when the client hangs up)
    ):
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        if not stream:
            ids = [token async for token in tokens]
            text = decoder.decode(bytes(ids), final=True)
            await send_json(send, 200, completion(request_id, text, ids, len(prompt)))
            return
        await start_events(send)
        async for token in tokens:
            chunk = completion(request_id, decoder.decode(bytes([token])), [token], len(prompt))
            del chunk["usage"]
            chunk["choices"][0]["finish_reason"] = None
            await send_event(send, chunk)
        await send_event(send, "[DONE]", last=True)


# ---- the engine process -------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m trio_pd._serve.engine SETTINGS_JSON``: run one engine until SIGTERM/SIGINT."""
    parser = argparse.ArgumentParser(prog="trio_pd._serve.engine")
    parser.add_argument("settings", help="EngineSettings as JSON")
    args = parser.parse_args(argv)
    settings = EngineSettings(**json.loads(args.settings))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    torch.set_num_threads(1)
    trio.run(serve_engine, settings)


async def serve_engine(settings: EngineSettings, grace: float = 10.0) -> None:
    """Serve until SIGTERM or SIGINT, then drain: stop accepting, let requests
    finish (at most ``grace`` s), close the connector."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    disable_created_metrics()  # type: ignore[no-untyped-call]  # (a process of its own)
    engine = Engine(settings, TinyLlama(ModelConfig()))
    config = Config()
    config.bind = [f"{settings.host}:{settings.http_port}"]
    config.graceful_timeout = grace
    config.accesslog = None
    stop = trio.Event()
    app: Any = build_app(engine)  # (hypercorn's ASGI types are stricter than plain dicts)
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def until_signal() -> None:
                async for _ in signals:
                    engine.accepting = False
                    stop.set()
                    return

            nursery.start_soon(until_signal)
            binds = await nursery.start(
                functools.partial(serve, app, config, shutdown_trigger=stop.wait)
            )
            if settings.ready_file:
                write_json_atomically(settings.ready_file, {"url": binds[0]})
            await stop.wait()
            # (serve drains and returns; until_signal has returned)


def write_json_atomically(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` so that a reader never sees half of it."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        json.dump(data, f)
    os.replace(temporary, path)


if __name__ == "__main__":
    main()
