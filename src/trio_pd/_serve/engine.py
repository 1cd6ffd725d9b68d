"""An engine server: the tiny model, its paged KV cache, its connectors, HTTP on trio.

Each engine is a process running hypercorn's trio worker. Its connector --
one per tensor-parallel rank: rank ``r`` registers its head slice of the KV
cache and listens on the base port + ``r`` -- is opened in the ASGI
*lifespan*, so it lives exactly as long as the server accepts requests:
requests run while it is open, and it closes (releasing NIXL and ZeroMQ)
after the last one drained. (The ranks share this process: the model
computes for all of them; their KV caches and connectors are separate, as on
a real tensor-parallel engine.)

``POST /v1/completions`` and ``POST /v1/chat/completions`` follow OpenAI's
API (:mod:`trio_pd._serve.openai`; a chat's prompt is its templated
conversation) and vLLM's P/D conventions (``kv_transfer_params``):

* ``{"do_remote_decode": true}``: prefill only. The engine computes the
  prompt's KV cache into blocks and its first generated token, exposes the
  blocks, and answers with that token and ``kv_transfer_params`` that a
  decode engine pulls with (``first_token`` among them). The blocks return
  to the pool when the decode engine has read them (or the exposure expired).
* ``{"do_remote_prefill": true, ...}`` (what a prefill engine returned): the
  engine pulls those blocks over NIXL, then decodes from ``first_token``
  (without it, vLLM's shape: from the prompt's last token).
* neither: the engine runs the whole request itself -- or, on a decode-first
  engine (``prefill_urls``), runs its prefill on a prefill engine and then
  decodes it as above (:func:`~.app.build_app`'s handlers).

Both paths run the same model steps, so disaggregated output equals
single-engine output token for token (see :mod:`trio_pd._serve.model`).

``GET /health`` says whether the engine accepts requests; ``GET /metrics``
is Prometheus text (the connector's statistics, requests, pull latency).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import attrs
import trio
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from trio_util import AsyncValue

from trio_pd._connector import Connector
from trio_pd._core._errors import IncompatibleEngineError, ParamsRejectedError
from trio_pd._core._public_values import RemoteBlocks
from trio_pd._curve_keys import CurveAuth
from trio_pd._exception_groups import first_failure_wins
from trio_pd._serve import defaults
from trio_pd._serve.asgi import parse_json
from trio_pd._serve.binding import SEND_TIMEOUT, check_send_timeout, is_wildcard
from trio_pd._serve.errors import HTTPError, ParamsInUse
from trio_pd._serve.keys import BearerKeys
from trio_pd._serve.metrics import ConnectorCollector
from trio_pd._serve.model import ModelConfig, TinyLlama
from trio_pd._serve.openai import (
    FIRST_TOKEN_PARAM,
    LEASE_PARAM,
    MAX_MODEL_LEN,
    check_prompt_blocks,
    first_token_of,
    parse_remote_blocks,
)
from trio_pd._serve.pool import BlockPool
from trio_pd._serve.prefill_channel import ChannelAnswer, PrefillChannelServer
from trio_pd._serve.prefilling import Prefiller
from trio_pd._serve.routing import url_problem
from trio_pd._serve.timing import PhaseTimes

logger = logging.getLogger("trio_pd.serve")


@attrs.frozen
class EngineSettings:
    """One engine's settings (``trio-pd engine``'s flags)."""

    engine_id: str
    http_port: int
    side_channel_port: int = 0  # rank r listens on this + r (0: free ports)
    host: str = "127.0.0.1"  # where HTTP and the side channel bind (may be a wildcard)
    advertise_host: str = ""  # what peers and the proxy dial (default: host)
    num_blocks: int = 1024
    abort_timeout: float = defaults.ABORT_TIMEOUT
    ready_file: str = ""  # written with {"url": ...} once the engine accepts requests
    tp_size: int = 1
    max_model_len: int = MAX_MODEL_LEN
    admission_timeout: float = defaults.ADMISSION_TIMEOUT  # (waiting for free KV blocks)
    # Exposures: held lease_initial unless the decode engine holds them (it
    # renews every heartbeat_interval while the request waits for its
    # blocks), abort_timeout at most. (The proxy's deadlines depend on them:
    # see _serve.defaults.)
    lease_initial: float = defaults.LEASE_INITIAL
    lease_renewal: float = defaults.LEASE_RENEWAL
    heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL
    grace: float = defaults.GRACE  # how long requests in flight may drain after SIGTERM
    # How long an answer may wait for a client that stopped reading before
    # the kernel resets its connection (and the request is cancelled).
    send_timeout: float = SEND_TIMEOUT
    # A decode-first engine (--prefill-url): it takes clients' requests and
    # runs their prefill on one of these prefill engines itself
    # (:mod:`.app`, :mod:`.prefilling`), each attempt within prefill_timeout.
    prefill_urls: tuple[str, ...] = ()
    prefill_timeout: float = defaults.PREFILL_TIMEOUT
    # Prefill requests over a kept TCP connection (:mod:`.prefill_channel`): an engine that
    # serves them listens for them there too; a decode-first engine sends
    # them there once connected. False: HTTP only (either side).
    prefill_channel: bool = True

    def advertised(self) -> str:
        """The host that peers and the proxy dial."""
        return self.advertise_host or self.host

    def check(self) -> None:
        """Raises ValueError naming the setting (as a command-line flag) that is wrong."""
        if self.num_blocks < 1:
            raise ValueError(f"--num-blocks must be at least 1 (got {self.num_blocks})")
        if not 1 <= self.max_model_len <= MAX_MODEL_LEN:
            raise ValueError(f"--max-model-len must be in [1, {MAX_MODEL_LEN}]")
        if not self.grace > 0:  # (NaN too)
            raise ValueError("--grace must be > 0")
        check_send_timeout(self.send_timeout)
        if not (math.isfinite(self.lease_initial) and self.lease_initial > 0):
            raise ValueError("--lease-initial must be a positive number of seconds")
        defaults.check_admission(self.admission_timeout, self.abort_timeout)
        if self.lease_initial > self.abort_timeout:
            raise ValueError(
                f"--lease-initial must be at most the exposure's cap ({self.abort_timeout:g} s)"
            )
        heads = ModelConfig().kv_heads
        if self.tp_size < 1 or heads % self.tp_size:
            raise ValueError(f"--tp {self.tp_size} must divide the model's {heads} KV heads")
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"--port {self.http_port} is not a port")
        if not 0 <= self.side_channel_port <= 65536 - self.tp_size:
            raise ValueError(
                f"--side-channel-port {self.side_channel_port} leaves no port for "
                f"{self.tp_size} ranks"
            )
        for url in self.prefill_urls:
            problem = url_problem(url)
            if problem is not None:
                raise ValueError(f"--prefill-url {url!r}: {problem}")
        if not (math.isfinite(self.prefill_timeout) and self.prefill_timeout > 0):
            raise ValueError("--prefill-timeout must be a positive number of seconds")
        if is_wildcard(self.advertised()):
            raise ValueError(
                f"--host {self.host!r} binds every interface, which nobody can dial: pass "
                "--advertise-host <this host's address on the peers' network>"
            )


EXPOSURE_SECRET_ENV = "TRIO_PD_EXPOSURE_SECRET"
"""The environment variable that hands an engine its deployment's exposure
secret (hex): not on the command line, where ``ps`` shows it."""


class EngineMetrics:
    """An engine's Prometheus metrics (its own registry): its requests, its
    pulls' times, its free KV blocks, and its connectors' statistics."""

    def __init__(
        self, free_blocks: Callable[[], int], connectors: Callable[[], list[Connector]]
    ) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "trio_pd_serve_requests",
            "Completion and chat requests by kind (prefill, decode, whole) "
            "and outcome (ok, error, disconnected, stalled: the client stopped reading and "
            "its connection was reset after --send-timeout).",
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
            "KV-cache blocks free in the engine's pool (all of them when idle: nothing leaked).",
            registry=self.registry,
        )
        free.set_function(free_blocks)
        self.connectors = ConnectorCollector(connectors)
        self.registry.register(self.connectors)


class Engine:
    """The model, its cache and block pool, and the requests on them.

    Owns the KV cache tensors (registered with the connector), the block
    pool, and the tasks that give exposed blocks back to the pool
    (``nursery``, the server's). Forwards run in a worker thread, one at a
    time (``compute``), so the trio loop stays free for I/O.
    """

    def __init__(
        self,
        settings: EngineSettings,
        model: TinyLlama,
        *,
        exposure_secret: bytes | None = None,
        internal_keys: BearerKeys | None = None,
        curve: CurveAuth | None = None,
        client_keys: BearerKeys | None = None,
        internal_key: str | None = None,
    ) -> None:
        self.settings = settings
        self.exposure_secret = exposure_secret  # signs / checks kv_transfer_params
        self.internal_keys = internal_keys  # who may call /v1/* (the proxy), if set
        # A decode-first engine faces clients: these keys guard its /v1/*
        # instead (None: open), and it sends the internal key to its prefill
        # engines (set by the lifespan: the prefiller, while serving).
        self.client_keys = client_keys
        self.internal_key = internal_key
        self.prefiller: Prefiller | None = None
        self.prefill_channel: PrefillChannelServer | None = None  # (set by the lifespan)
        self.prefill_channel_port: int | None = None  # (set by the lifespan, while serving)
        self.channel_requests = AsyncValue(0)  # (prefill channel requests running now)
        self.curve = curve  # the side channel's CURVE keys, if set
        self.model = model
        self.cache = model.new_cache(settings.num_blocks, settings.tp_size)
        self.pool = BlockPool(settings.num_blocks)
        self.compute = trio.CapacityLimiter(1)
        self.connectors: list[Connector] = []  # one per rank, while serving
        self.nursery: trio.Nursery | None = None
        self.accepting = False
        # Set by the lifespan before it reports start-up to the server: whether
        # the connectors opened, or why not (hypercorn reports its own start
        # even when the lifespan failed; the engine process trusts only these).
        self.started = False
        self.startup_failure = ""
        # Exposures handed out and not yet resolved (read, expired or
        # abandoned): the drain waits for them before the connectors close.
        self.exposures_unresolved: AsyncValue[int] = AsyncValue(0)
        self.drain_deadline = math.inf  # (set when the drain starts: it ends by then)
        self._ids = itertools.count()
        # The parameters of the decode requests under way (a refused request
        # that names them does not abandon what another request reads).
        self._decoding: set[RemoteBlocks] = set()
        self.metrics = EngineMetrics(lambda: self.pool.free, lambda: self.connectors)
        self.registry = self.metrics.registry
        self.requests = self.metrics.requests
        self.pull_seconds = self.metrics.pull_seconds

    @property
    def guard(self) -> BearerKeys | None:
        """The keys a call to ``/v1/*`` must present (``None``: none): a
        decode-first engine's client keys, any other engine's internal key."""
        return self.client_keys if self.settings.prefill_urls else self.internal_keys

    def request_id(self, base: str, prefix: str = "cmpl") -> str:
        """A request id unique in this engine that contains ``base`` (the
        request's ``X-Request-Id``: clients and proxies may repeat one)."""
        return f"{prefix}-{base}-{self.settings.engine_id}-{next(self._ids)}"

    def max_model_len(self) -> int:
        """The most tokens (prompt plus generated) one request can hold here:
        ``max_model_len``, or the whole KV pool if that is smaller."""
        pool = self.pool.num_blocks * self.model.config.block_size
        return min(self.settings.max_model_len, pool)

    async def step(self, table: Sequence[int], tokens: Sequence[int], start: int) -> int:
        return await trio.to_thread.run_sync(
            self.model.forward, self.cache, table, tokens, start, limiter=self.compute
        )

    def _prompt_steps(self, table: Sequence[int], prompt: list[int]) -> int:
        """A whole request's first two steps (in a worker thread): the prompt
        without its last token, then that token; the first generated token."""
        if len(prompt) > 1:
            self.model.forward(self.cache, table, prompt[:-1], 0)
        return self.model.forward(self.cache, table, prompt[-1:], len(prompt) - 1)

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
                code="context_length_exceeded",
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

    async def prefill_for_remote(
        self, request_id: str, prompt: list[int], times: PhaseTimes | None = None
    ) -> tuple[int, dict[str, Any]]:
        """Compute the prompt's KV and its first generated token; expose the blocks.

        Runs the same two steps as a whole request here (the prompt without
        its last token, then the last token), so the blocks hold every
        prompt position and the token is the one a single engine would have
        generated first. Returns it and the ``kv_transfer_params`` that a
        decode engine pulls with (they carry the token as
        :data:`~.openai.FIRST_TOKEN_PARAM`, so the decode starts from it).

        The blocks go back to the pool once every rank's exposure resolved
        (read, abandoned or expired). ``times`` gets the phases ``admission``,
        ``forward`` (both steps) and ``expose``.

        Raises:
            OutOfBlocks: not enough blocks freed within ``admission_timeout``.
        """
        times = times or PhaseTimes()
        connectors = self._connectors()
        self.check_fits(prompt, 1)
        with times.phase("admission"):
            blocks = await self.pool.allocate(
                self.model.config.blocks_for(len(prompt)), deadline=self.admission_deadline()
            )
        try:
            with times.phase("forward"):  # (both steps in one trip to the worker thread)
                first = await trio.to_thread.run_sync(
                    self._prompt_steps, blocks, prompt, limiter=self.compute
                )
            # Every rank exposes its head slice; rank 0's parameters go to the
            # decode engine (they name the base port and the TP size).
            with times.phase("expose"):
                exposed = [connector.expose(request_id, blocks) for connector in connectors]
            remote = exposed[0]
        except BaseException:
            self.pool.release(blocks)
            raise
        assert self.nursery is not None
        self.exposures_unresolved.value += 1
        self.nursery.start_soon(self._release_when_released, connectors, request_id, blocks)
        # (the lease tells the proxy how long it may take to start the decode)
        lease = {LEASE_PARAM: self.settings.lease_initial}
        params = {**remote.to_kv_transfer_params(), "do_remote_prefill": True, **lease}
        return first, {**params, FIRST_TOKEN_PARAM: first}

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
            self.exposures_unresolved.value -= 1

    @asynccontextmanager
    async def generation(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        params: dict[str, Any] | None,
        times: PhaseTimes | None = None,
        *,
        params_later: Callable[[], Awaitable[dict[str, Any]]] | None = None,
        held: Callable[[], Awaitable[None]] | None = None,
        give_back_unheld: bool = False,
    ) -> AsyncIterator[AsyncGenerator[int, None]]:
        """Blocks for the whole request, the prompt's KV in them, and a token iterator.

        With ``params`` (from a prefill engine) the prompt's KV is pulled;
        without, computed here. ``times`` gets the phases before the first
        token: ``hold`` (with ``params``), ``admission``, then ``pull`` or
        ``forward`` (the prompt's KV computed here). Waits up to ``admission_timeout`` for free
        blocks; meanwhile every rank *holds* the prefill's blocks (renewing
        their lease), and if the request fails or is cancelled before its
        pull, leaving the hold gives them back to the prefill engine at once.
        The blocks go back to the pool when the block exits --
        unless a transfer that could not be stopped may still write them
        (``Connector.unsettled_blocks``, whichever way the pull ended): then
        only once it has settled.

        ``held`` is awaited once every rank holds the blocks and their
        parameters checked (before admission and the pull: a decode-first
        engine streams the prefill's first token then); a failure in it
        leaves the holds, giving the blocks back. With ``give_back_unheld``
        (a decode-first engine's request: nobody else has its parameters),
        a request that ends before every rank held the blocks gives them
        back too (:meth:`give_back`).

        With ``params_later`` instead (concurrent dispatch, :mod:`.dispatch`),
        the parameters are what it returns once the prefill answered (phase
        ``params``); then the same. The request takes no KV blocks before
        they come: decode blocks held while waiting for a prefill that
        itself waits for prefill blocks, held by exposures whose decode
        requests wait for decode blocks, would deadlock both pools (until
        the admission timeouts).

        Raises:
            HandshakeError, TransferError: the pull failed.
            ParamsRejectedError: ``params`` claim what the producer did not
                issue, or name a TP size that this engine cannot read from.
            ParamsInUse: another request holds the same ``params``.
            HTTPError: ``params`` are malformed or do not match the prompt (400).
            OutOfBlocks: not enough blocks freed within ``admission_timeout``.
        """
        config = self.model.config
        times = times or PhaseTimes()
        before = len(prompt) - 1
        if params_later is not None:
            self.check_fits(prompt, max_tokens)  # (a request that can never run: before it waits)
            with times.phase("params"):
                params = await params_later()
        remote: RemoteBlocks | None = None
        first: int | None = None  # (the prefill engine's first token, if it sent one)
        if params is not None:
            remote = parse_remote_blocks(params)
        connectors = self._connectors()
        blocks: list[int] | None = None
        # (a second request with the same parameters fails at its hold: ParamsInUse)
        ours = remote if remote is not None and remote not in self._decoding else None
        if ours is not None:
            self._decoding.add(ours)
        holding = False
        try:
            async with AsyncExitStack() as holds:
                if remote is not None:
                    # Every rank holds the prefill's blocks until its pull: the
                    # producer keeps them however long admission takes, and
                    # frees them at once if this request fails or its client
                    # leaves before the pull (leaving a hold abandons it).
                    for connector in connectors:
                        try:
                            with times.phase("hold"):
                                await holds.enter_async_context(connector.hold(remote))
                        except ParamsRejectedError:
                            raise
                        except ValueError as exc:  # (the same parameters in two requests)
                            raise ParamsInUse(str(exc)) from None
                        except IncompatibleEngineError as exc:  # (before any I/O: the params')
                            raise ParamsRejectedError(
                                request_id, "tp_size", f"cannot be read here: {exc.reason}"
                            ) from None
                holding = True
                if params is not None and remote is not None:  # (checked once held: a
                    # refusal here gives the blocks back as it leaves the hold)
                    first = first_token_of(params, config.vocab)
                    if first is not None:
                        before = len(prompt)  # (the blocks hold the prompt's last token too)
                    check_prompt_blocks(remote, config.blocks_for(before), len(prompt))
                if held is not None:
                    await held()
                self.check_fits(prompt, max_tokens)
                with times.phase("admission"):
                    blocks = await self.pool.allocate(
                        config.blocks_for(len(prompt) + max_tokens),
                        deadline=self.admission_deadline(),
                    )
                if remote is not None:
                    started = time.monotonic()
                    into = blocks[: len(remote.block_ids)]
                    with times.phase("pull"):
                        await _pull_every_rank(connectors, request_id, into, remote)
                    self.pull_seconds.observe(time.monotonic() - started)
                elif before > 0:
                    with times.phase("forward"):
                        await self.step(blocks, prompt[:-1], 0)
            yield self._tokens(blocks, prompt, max_tokens, first)
        finally:
            if ours is not None:
                self._decoding.discard(ours)
            if give_back_unheld and not holding and params is not None:
                self.give_back({"kv_transfer_params": params})
            if blocks is not None:
                self._release_when_settled(connectors, blocks)

    def give_back(self, body: object) -> None:
        """Abandon, in the background, the exposure that a refused request's
        ``kv_transfer_params`` name, so that its prefill engine has the blocks
        back at once (within one side-channel round trip) instead of when the
        lease runs out.

        For a request refused before it held them (a bad field, an unknown
        model, a draining engine); one refused while holding them abandons
        them as it leaves the hold. Nothing is sent for parameters that do
        not parse, that another request of this engine is decoding (the same
        parameters sent twice), or whose token does not verify (the producer
        would refuse it: nobody but the prefill engine's own parameters can
        abandon an exposure). Never raises.
        """
        params = body.get("kv_transfer_params") if isinstance(body, dict) else None
        if not isinstance(params, dict) or not self.connectors or self.nursery is None:
            return
        try:
            remote = RemoteBlocks.from_kv_transfer_params(params)
        except ValueError:
            return
        if remote in self._decoding:
            return
        self.nursery.start_soon(self._abandon, list(self.connectors), remote)

    def give_back_answer(self, answer: ChannelAnswer) -> None:
        """Give back (see :meth:`give_back`) the exposure that a prefill
        answer names which no request of this engine will read: one that
        came over a prefill channel after its request had stopped waiting
        (its client left while the prefill ran). Without this the prefill
        engine would hold those blocks until their lease ran out. Never raises.
        """
        if answer.status_code != 200:
            return
        try:
            body = parse_json(answer.content)
        except (ValueError, RecursionError):
            return
        self.give_back(body)

    async def _abandon(self, connectors: list[Connector], remote: RemoteBlocks) -> None:
        """Every rank abandons ``remote`` (best effort: a failure is logged)."""

        async def abandon(connector: Connector) -> None:
            try:
                await connector.abandon(remote)
            except (ValueError, IncompatibleEngineError, trio.ClosedResourceError) as exc:
                # (ParamsRejectedError is a ValueError: forged or garbled parameters)
                logger.debug(
                    "engine %s: the exposure of %r not abandoned: %s",
                    self.settings.engine_id,
                    remote.request_id,
                    exc,
                )

        async with trio.open_nursery() as nursery:
            for connector in connectors:
                nursery.start_soon(abandon, connector)

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
        self, blocks: list[int], prompt: list[int], max_tokens: int, first: int | None = None
    ) -> AsyncGenerator[int, None]:
        """``max_tokens`` greedy tokens from the prompt's last token (its KV
        not in ``blocks`` yet) -- or, given the ``first`` token that a prefill
        engine computed from it, that token, then the rest from it."""
        token, position, steps = prompt[-1], len(prompt) - 1, max_tokens
        if first is not None:
            yield first
            token, position, steps = first, len(prompt), max_tokens - 1
        for _ in range(steps):
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
    running transfer end first) and propagates alone -- also when several
    ranks fail at once for the same reason (a forged token, an engine in
    backoff), which a plain nursery would raise as a group.
    """
    await first_failure_wins(
        [functools.partial(connector.pull, request_id, blocks, remote) for connector in connectors]
    )
