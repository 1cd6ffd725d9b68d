"""A soak across hosts: real engines, real faults, for minutes; every count that must be 0.

    python benchmarks/soak.py                      # 600 s
    python benchmarks/soak.py --seconds 60 --seed 7
    nox -s soak [-- --seconds N]                   # and rewrite its section of docs/performance.md

Root only (test hosts are network namespaces). Prefill engines run as real
processes (``open_prefill_worker``), one per test host, each behind its
own veth link; the decoder is a connector in this process, in the root
namespace, created after the links exist; UCX runs over TCP, so every byte
crosses a link; side channels are real ZeroMQ sockets; every exposure is
signed (``exposure_secret``). Meanwhile, at random (seeded, the seed is
printed), concurrently:

* ``--clients`` tasks expose and pull, many at once, verifying every byte;
  some pulls are held first (``Connector.hold``), some holds end without a
  pull (an abandon), some requests are abandoned (``Connector.abandon``),
  some pulls are cancelled after a short random delay;
* producers are killed (``PrefillWorker.kill``) and restarted on the same
  host and port (a new incarnation);
* links are cut and restored (``TestHost.cut`` / ``restore``);
* ``--forgers`` tasks send forged requests (a real ``RemoteBlocks`` with
  another incarnation, block ids, request id, port, TP size or engine; some
  re-signed with the deployment's secret, so they get past the token to
  the checks behind it), then pull the real request they forged from.

Every operation runs under the bound its documentation gives
(``soak_ledger.SoakConfig``); one that exceeds it is counted as a hang. A
valid request that fails is classified against the fault timeline (its
producer killed, its link cut, in its window), never by its error type;
the rest are unexplained. After the run: links restored, a settle period
(no decode block may stay unsettled), a drain period (no exposure may stay
pending). The exit status is non-zero if any must-be-zero count is not.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import json
import logging
import math
import os
import random
import secrets
import shutil
import sys
import time
import traceback
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import numpy as np
import torch
import trio
from pd_bench import machine
from soak_ledger import (
    CUT,
    FORGED,
    KILLED,
    MUST_BE_ZERO,
    UNEXPLAINED,
    DecodeBlocks,
    FaultTimeline,
    Ledger,
    ProducerBlocks,
    SoakConfig,
)

import trio_pd
from trio_pd._core._tokens import exposure_token
from trio_pd.testing import (
    PrefillWorker,
    TestHost,
    TestHostsUnavailable,
    WorkerError,
    WorkerSpec,
    open_prefill_worker,
    open_test_hosts,
)

TCP = {"UCX_TLS": "tcp", "NIXL_LOG_LEVEL": "WARN"}
STARTUP_TIMEOUT = 60.0
_T = TypeVar("_T")
UNAVAILABLE = 77
"""The exit status when test hosts cannot be made here (not root, no ``ip``)."""
PULL_ERRORS = (trio_pd.HandshakeError, trio_pd.TransferError, trio_pd.ParamsRejectedError)

MODES = {  # how a client consumes a valid request, and how often
    "pull": 16,
    "hold, pull": 12,
    "long hold, pull": 1,
    "hold, no pull": 4,
    "abandon": 4,
    "hold, abandon": 4,
    "cancelled pull": 8,
    "hold, cancelled pull": 4,
}
FORGERIES = [  # what a forger changes; "re-signed": with a token that matches the forgery
    "incarnation",
    "incarnation, re-signed",
    "block ids",
    "request id",
    "port",
    "port, re-signed",
    "tp_size",
    "tp_size, re-signed",
    "engine id, re-signed",
    "no token",
    "abandon of another request",
]


@attrs.define(eq=False)
class Slot:
    """A test host and the prefill worker running there now (if any)."""

    index: int
    host: TestHost
    engine_id: str
    worker: PrefillWorker | None = None
    generation: int = 0
    blocks: ProducerBlocks | None = None
    stop: trio.Event = attrs.field(factory=trio.Event)
    live: dict[str, trio_pd.RemoteBlocks] = attrs.field(factory=dict)
    """Valid requests exposed here and not yet done with (forgers steal their ids)."""


@attrs.define(eq=False)
class Request:
    """One valid request: where it was exposed, and what became of it."""

    slot: Slot
    generation: int
    request_id: str
    seed: int
    started: float
    blocks: ProducerBlocks
    remote: trio_pd.RemoteBlocks | None = None
    outcome: str = ""
    pulled: bool = False
    pull_ended: float = math.inf
    held: bool = False
    abandoned: bool = False
    left: int = 2
    """Until both the exposure resolved and the consumer side is done."""


class Soak:
    """The run: its slots, the decoder, the ledger and the tasks that use them."""

    def __init__(
        self,
        config: SoakConfig,
        seed: int,
        slots: list[Slot],
        decoder: trio_pd.Connector,
        blocks: DecodeBlocks,
        secret: bytes,
    ) -> None:
        self.config = config
        self.seed = seed
        self.slots = slots
        self.decoder = decoder
        self.blocks = blocks
        self.secret = secret
        self.connector_config = config.connector_config(secret)
        self.timeline = FaultTimeline(len(slots), config.aftermath)
        self.ledger = Ledger()
        self.stopping = False
        self.shutting_down = False
        self.started_at = trio.current_time()
        self.watchers: trio.Nursery | None = None
        self._next = 0
        self.quarantined: set[int] = set()

    # ---- small helpers ----------------------------------------------------------

    def now(self) -> float:
        return trio.current_time() - self.started_at

    def next_id(self, prefix: str) -> tuple[str, int]:
        self._next += 1
        return f"{prefix}{self._next}", self._next

    def pick_slot(self, rng: random.Random) -> Slot | None:
        live = [s for s in self.slots if s.worker is not None and s.blocks is not None]
        return rng.choice(live) if live else None

    def failed(self, request: Request, operation: str, error: BaseException) -> None:
        """A valid request's ``operation`` failed: classify it by the fault timeline."""
        ended = trio.current_time()
        cause = self.timeline.classify(
            request.slot.index, request.generation, request.started, ended
        )
        key = f"{cause}: {operation}: {type(error).__name__}"
        self.ledger.failures[key] += 1
        if cause not in (KILLED, CUT):
            self.ledger.note(
                f"{key}: {request.request_id} on {request.slot.engine_id} generation "
                f"{request.generation}, t={request.started - self.started_at:.2f}.."
                f"{ended - self.started_at:.2f}: {error}"
            )

    def unexpected(self, where: str, error: BaseException) -> None:
        self.ledger.counts["unexpected_errors"] += 1
        text = "".join(traceback.format_exception(error)).rstrip()
        self.ledger.note(f"unexpected error in {where} at t={self.now():.2f}: {text}")
        print(f"soak: unexpected error in {where}:\n{text}", file=sys.stderr, flush=True)

    async def bounded(
        self, operation: str, bound: float, what: str, call: Callable[[], Awaitable[Any]]
    ) -> tuple[bool, Any]:
        """``(True, result)`` of ``call()``, or ``(False, None)`` counted as a hang
        if it ran past ``bound`` (it is cancelled then)."""
        with trio.move_on_after(bound) as scope:
            return True, await call()
        if scope.cancelled_caught:
            self.ledger.hang(operation, bound, what)
        return False, None

    # ---- producers --------------------------------------------------------------

    def worker_spec(self, slot: Slot) -> WorkerSpec:
        c = self.config
        return WorkerSpec(
            slot.engine_id,
            regions=c.regions,
            blocks=c.producer_blocks,
            block_shape=(c.block_bytes // 2,),
            dtype="float16",
            host=slot.host.address,
            port=c.port,
            netns=slot.host.netns,
            env=TCP,
        )

    async def run_slot(
        self, slot: Slot, rng: random.Random, *, task_status: trio.TaskStatus[None]
    ) -> None:
        """Keep a worker running in ``slot``: start it, and when told, kill it and
        start another (a new incarnation on the same host and port)."""
        started = False
        while not self.shutting_down:
            slot.generation += 1
            slot.stop = trio.Event()
            spawned = trio.current_time()
            try:
                async with open_prefill_worker(
                    self.worker_spec(slot),
                    config=self.connector_config,
                    startup_timeout=STARTUP_TIMEOUT,
                ) as worker:
                    slot.worker, slot.blocks, slot.live = (
                        worker,
                        ProducerBlocks(self.config.producer_blocks),
                        {},
                    )
                    now = trio.current_time()
                    self.timeline.started(slot.index, slot.generation, spawned, now)
                    if slot.generation in self.timeline.started_in_cut(slot.index):
                        self.ledger.counts["producer_starts_in_cut"] += 1
                        self.ledger.note(
                            f"{slot.engine_id} generation {slot.generation} started while its "
                            f"link was cut (t={spawned - self.started_at:.2f}.."
                            f"{now - self.started_at:.2f})"
                        )
                    self.ledger.counts["producer_starts"] += 1
                    if not started:
                        started = True
                        task_status.started()
                    await slot.stop.wait()
                    slot.worker = slot.blocks = None
                    if self.shutting_down:
                        return  # closes the worker: its connector shuts down cleanly
                    self.timeline.killed(slot.index, slot.generation, trio.current_time())
                    self.ledger.counts["producer_kills"] += 1
                    worker.kill()
            except trio.TooSlowError as exc:
                if not started:
                    raise
                self.ledger.hang("producer start", STARTUP_TIMEOUT, f"{slot.engine_id}: {exc}")
            except WorkerError as exc:
                if not started:
                    raise
                self.unexpected(f"restarting {slot.engine_id}", exc)
            slot.worker = slot.blocks = None
            await trio.sleep(rng.uniform(*self.config.restart_after))

    async def killer(self, rng: random.Random) -> None:
        while True:
            await trio.sleep(rng.expovariate(1 / self.config.kill_every))
            slot = self.pick_slot(rng)
            if slot is not None:
                slot.stop.set()

    async def cutter(self, rng: random.Random) -> None:
        while True:
            await trio.sleep(rng.expovariate(1 / self.config.cut_every))
            slot = rng.choice(self.slots)
            interval = self.timeline.cut(slot.index, trio.current_time())
            self.ledger.counts["link_cuts"] += 1
            try:
                await slot.host.cut()
                await trio.sleep(rng.uniform(*self.config.cut_for))
            finally:
                with trio.CancelScope(shield=True):
                    await slot.host.restore()
                    interval[1] = trio.current_time()
                    self.ledger.counts["link_cut_ms"] += round((interval[1] - interval[0]) * 1e3)

    # ---- valid requests ---------------------------------------------------------

    async def expose(self, slot: Slot, count: int) -> Request | None:
        """Expose ``count`` producer blocks of ``slot`` as a new valid request."""
        worker, blocks = slot.worker, slot.blocks
        assert worker is not None
        assert blocks is not None
        request_id, seed = self.next_id("v")
        ids = blocks.take(count, request_id)
        if ids is None:
            self.ledger.counts["producer_full"] += 1
            await trio.sleep(0.01)
            return None
        request = Request(slot, slot.generation, request_id, seed, trio.current_time(), blocks)
        try:
            ok, remote = await self.bounded(
                "expose",
                self.config.worker_call_bound,
                request_id,
                lambda: self.worker_call(worker.expose, request_id, ids, seed),
            )
        except WorkerError as exc:
            self.failed(request, "expose", exc)
            return None
        if not ok:
            return None
        request.remote = remote
        slot.live[request_id] = remote
        self.ledger.counts["exposed"] += 1
        assert self.watchers is not None
        self.watchers.start_soon(self.watch, request, worker)
        return request

    async def watch(self, request: Request, worker: PrefillWorker) -> None:
        """Wait for the exposure to resolve, within its bound."""
        bound = max(0.0, self.config.released_bound - (trio.current_time() - request.started))
        try:
            ok, outcome = await self.bounded(
                "wait_released",
                bound,
                request.request_id,
                lambda: self.worker_call(worker.wait_released, request.request_id),
            )
        except WorkerError as exc:
            request.outcome = "producer gone"
            if not self.timeline.was_killed(request.slot.index, request.generation):
                self.unexpected(f"wait_released({request.request_id!r}), producer not killed", exc)
        except Exception as exc:
            request.outcome = "error"
            self.unexpected(f"wait_released({request.request_id!r})", exc)
        else:
            request.outcome = outcome.value if ok else "no answer"
        self.ledger.outcomes[request.outcome] += 1
        self.finish(request)

    async def worker_call(self, command: Callable[..., Awaitable[_T]], *args: Any) -> _T:
        """A command to a prefill worker (``PrefillWorker.expose``, ...).

        ``PrefillWorker`` raises ``trio.ClosedResourceError`` (or
        ``BrokenResourceError``) instead of ``WorkerError`` when its worker
        goes away while the command is being sent (the command passed its
        "is the worker gone?" check, then waited for the pipe while the
        worker's context closed it): a bug in ``trio_pd.testing``, reported
        by this soak under ``findings``. It is treated as the ``WorkerError``
        it should be, which is then classified like any other.
        """
        try:
            return await command(*args)
        except (trio.ClosedResourceError, trio.BrokenResourceError) as exc:
            name = type(exc).__name__
            self.ledger.findings[f"PrefillWorker raised {name}, not WorkerError"] += 1
            raise WorkerError(f"worker gone ({name}: {exc})") from exc

    def finish(self, request: Request) -> None:
        """One of the two ends of ``request`` (resolved; consumer done) happened."""
        request.left -= 1
        request.blocks.done(request.request_id)
        if request.left:
            return
        request.slot.live.pop(request.request_id, None)
        if not request.pulled or request.outcome not in ("abandoned", "expired"):
            return
        # Read, yet not released as read: explained only by a fault (the
        # notification lost), or, if expired, by a pull that came after the
        # lease ran out (not held, and late).
        now = trio.current_time()
        slot, generation, started = request.slot.index, request.generation, request.started
        cause = self.timeline.classify(slot, generation, started, now)
        late = request.pull_ended > started + self.config.lease_initial - self.config.slack
        if request.outcome == "abandoned" and not request.abandoned:
            # Nobody here abandoned it: someone else's abandon was applied to it.
            nearby = self.timeline.forged_nearby(slot, started, now)
            key = f"{FORGED if nearby else UNEXPLAINED}: exposure: resolved ABANDONED though read"
        elif request.outcome == "expired" and cause in (KILLED, CUT):
            self.ledger.counts["read_but_expired_in_a_fault"] += 1
            return
        elif request.outcome == "expired" and not request.held and late:
            self.ledger.counts["read_after_its_lease_ran_out"] += 1
            return
        elif request.outcome == "expired":
            key = f"{cause}: exposure: EXPIRED though read in time{' and held' * request.held}"
        else:
            return
        self.ledger.failures[key] += 1
        self.ledger.note(
            f"{key}: {request.request_id} on {request.slot.engine_id}, exposed at "
            f"t={started - self.started_at:.2f}, "
            f"pulled by t={request.pull_ended - self.started_at:.2f}"
        )

    async def client(self, rng: random.Random) -> None:
        modes, weights = list(MODES), list(MODES.values())
        c = self.config
        while not self.stopping:
            slot = self.pick_slot(rng)
            if slot is None:
                await trio.sleep(0.05)
                continue
            mode = rng.choices(modes, weights)[0]
            count = rng.choices(c.pull_sizes, c.pull_size_weights)[0]
            try:
                request = await self.expose(slot, count)
                if request is not None:
                    try:
                        await self.consume(request, mode, rng)
                    finally:
                        self.finish(request)
            except Exception as exc:  # a bug (the soak's or trio_pd's): count it, go on
                self.unexpected(f"client ({mode})", exc)

    async def consume(self, request: Request, mode: str, rng: random.Random) -> None:
        """What the decode side does with a valid request."""
        self.ledger.counts[f"mode: {mode}"] += 1
        cancel = rng.uniform(*self.config.cancel_after) if "cancelled" in mode else None
        if mode == "pull" or mode == "cancelled pull":
            await self.pull(request, cancel)
        elif mode == "abandon":
            request.abandoned = True
            await self.abandon(request)
        else:
            long = mode.startswith("long")
            wait = rng.uniform(*(self.config.long_hold_for if long else self.config.hold_for))
            await self.hold(request, mode, cancel, wait)

    async def hold(self, request: Request, mode: str, cancel: float | None, wait: float) -> None:
        assert request.remote is not None
        body_ended = math.inf
        request.held = True
        async with self.decoder.hold(request.remote):
            await trio.sleep(wait)  # a decode request queued
            if mode == "hold, no pull":
                request.abandoned = True  # (the hold's exit abandons)
            elif mode == "hold, abandon":
                request.abandoned = True
                await self.abandon(request)
            else:
                request.abandoned = cancel is not None  # a cancelled pull's hold abandons
                await self.pull(request, cancel)
            body_ended = trio.current_time()
        took = trio.current_time() - body_ended
        if took > self.config.abandon_bound:
            self.ledger.hang(
                "hold exit", self.config.abandon_bound, f"{request.request_id}: {took:.2f} s"
            )

    async def abandon(self, request: Request) -> None:
        remote = request.remote
        assert remote is not None
        self.ledger.counts["abandons"] += 1
        await self.bounded(
            "abandon",
            self.config.abandon_bound,
            request.request_id,
            lambda: self.decoder.abandon(remote),
        )

    async def allocate(self, count: int, what: str) -> list[int] | None:
        ok, ids = await self.bounded(
            "allocate decode blocks",
            self.config.allocate_bound,
            what,
            lambda: self.blocks.allocate(count),
        )
        return ids if ok else None

    async def pull(self, request: Request, cancel: float | None) -> None:
        """Pull ``request`` into fresh decode blocks (cancelled after ``cancel`` s if given),
        verify every byte, and give the blocks back once nothing can write them."""
        remote = request.remote
        assert remote is not None
        local = await self.allocate(len(remote.block_ids), request.request_id)
        if local is None:
            return
        c = self.config
        bound = c.pull_bound if cancel is None else c.cancelled_pull_bound(cancel)
        how = "hung"
        with trio.move_on_after(bound) as hung:
            with trio.move_on_after(math.inf if cancel is None else cancel) as cancelled:
                try:
                    result = await self.decoder.pull(request.request_id, local, remote)
                except PULL_ERRORS as exc:
                    self.failed(request, "pull", exc)
                    how = f"failed ({type(exc).__name__})"
                else:
                    how = "pulled"
                    request.pulled, request.pull_ended = True, trio.current_time()
                    wrong = self.blocks.wrong_bytes(local, request.seed)
                    self.ledger.counts["pulls_succeeded"] += 1
                    self.ledger.counts["bytes_pulled"] += result.bytes
                    self.ledger.pull_seconds.append(result.seconds)
                    if wrong:
                        self.ledger.counts["wrong_bytes"] += wrong
                        self.ledger.note(
                            f"wrong bytes: {wrong} in {request.request_id} from "
                            f"{request.slot.engine_id} (local {local})"
                        )
            if cancelled.cancelled_caught:
                how = "cancelled"
                self.ledger.counts["pulls_cancelled"] += 1
        if hung.cancelled_caught:
            self.ledger.hang(
                "pull" if cancel is None else "cancelled pull", bound, request.request_id
            )
        await self.give_back(local, f"{request.request_id} {how}", how == "pulled")

    async def give_back(self, local: list[int], how: str, returned: bool) -> None:
        """Return decode blocks to the pool. A pull that did not return may still
        have a transfer writing them: ``wait_settled`` first, as documented."""
        if not returned:
            if set(local) & self.decoder.unsettled_blocks():
                self.ledger.counts["pulls_unsettled"] += 1
            ok, _ = await self.bounded(
                "wait_settled",
                self.config.settle_bound,
                how,
                lambda: self.decoder.wait_settled(local),
            )
            if not ok:
                self.quarantined.update(local)  # never reused; counted if still stuck at the end
                return
        self.blocks.free(local, f"{how}, freed at t={self.now():.2f}")

    # ---- forged requests --------------------------------------------------------

    def forge(
        self, kind: str, remote: trio_pd.RemoteBlocks, slot: Slot, rng: random.Random
    ) -> tuple[trio_pd.RemoteBlocks, list[Slot]]:
        """A forgery of ``remote``, and the slots whose engines it names."""
        named = [slot]
        if kind.startswith("incarnation"):
            forged = attrs.evolve(remote, incarnation=secrets.token_hex(8))
        elif kind == "block ids":
            n = self.config.producer_blocks
            shift = rng.randrange(1, n)
            forged = attrs.evolve(remote, block_ids=[(b + shift) % n for b in remote.block_ids])
        elif kind in ("request id", "abandon of another request"):
            others = [r for r in slot.live.values() if r.request_id != remote.request_id]
            victim = rng.choice(others).request_id if others else f"x{remote.request_id}"
            forged = attrs.evolve(remote, request_id=victim)
        elif kind.startswith("port"):
            forged = attrs.evolve(remote, port=remote.port + 1)
        elif kind.startswith("tp_size"):
            forged = attrs.evolve(remote, tp_size=2)
        elif kind.startswith("engine id"):
            other = self.slots[(slot.index + 1) % len(self.slots)]
            forged = attrs.evolve(remote, engine_id=other.engine_id)
            named.append(other)
        elif kind == "no token":
            forged = attrs.evolve(remote, token="")
        else:
            raise ValueError(kind)
        if kind.endswith("re-signed"):
            token = exposure_token(
                self.secret,
                engine_id=forged.engine_id,
                host=forged.host,
                port=forged.port,
                incarnation=forged.incarnation,
                tp_size=forged.tp_size,
                request_id=forged.request_id,
                block_ids=forged.block_ids,
            )
            forged = attrs.evolve(forged, token=token)
        return forged, named

    async def forger(self, rng: random.Random) -> None:
        while not self.stopping:
            slot = self.pick_slot(rng)
            if slot is None:
                await trio.sleep(0.05)
                continue
            count = rng.choices(self.config.pull_sizes[:4])[0]
            kind = rng.choice(FORGERIES)
            try:
                request = await self.expose(slot, count)
                if request is None:
                    continue
                try:
                    assert request.remote is not None
                    forged, named = self.forge(kind, request.remote, slot, rng)
                    intervals = [
                        self.timeline.forged_started(s.index, trio.current_time()) for s in named
                    ]
                    try:
                        await self.forged_request(kind, forged)
                    finally:
                        for interval in intervals:
                            interval[1] = trio.current_time()
                    # Then the real request, validly, right after its forgery.
                    request.started = trio.current_time()
                    self.ledger.counts["mode: pull after a forgery"] += 1
                    await self.pull(request, None)
                finally:
                    self.finish(request)
            except Exception as exc:
                self.unexpected(f"forger ({kind})", exc)
            await trio.sleep(rng.uniform(0, 0.2))  # forgeries mixed in, not a flood

    async def forged_request(self, kind: str, forged: trio_pd.RemoteBlocks) -> None:
        """Send one forged request; it must fail."""
        request_id, _ = self.next_id("f")
        if kind.startswith("abandon"):
            try:
                await self.bounded(
                    "forged abandon",
                    self.config.abandon_bound,
                    request_id,
                    lambda: self.decoder.abandon(forged),
                )
            except trio_pd.ParamsRejectedError:
                # The decoder has the secret: it refuses to send a forged
                # abandon at all (the producer would refuse it too).
                self.ledger.forged[f"{kind} -> refused before sending"] += 1
            else:
                self.ledger.forged[f"{kind} -> sent"] += 1
            return
        local = await self.allocate(len(forged.block_ids), request_id)
        if local is None:
            return
        outcome, returned = "hung", False
        with trio.move_on_after(self.config.pull_bound) as hung:
            try:
                await self.decoder.pull(request_id, local, forged)
            except PULL_ERRORS as exc:
                outcome = type(exc).__name__
            else:
                outcome, returned = "ACCEPTED", True
                self.ledger.note(f"forged request accepted: {kind}: {forged}")
        if hung.cancelled_caught:
            self.ledger.hang("forged pull", self.config.pull_bound, f"{request_id} ({kind})")
        self.ledger.forged[f"{kind} -> {outcome}"] += 1
        await self.give_back(local, f"{request_id} forged ({kind}) {outcome}", returned)

    # ---- the end ----------------------------------------------------------------

    async def drain(self) -> tuple[int, int]:
        """After the last request: links are up; wait for the decode blocks to settle
        and the exposures to resolve. Returns (stranded exposures, stranded blocks)."""
        c = self.config
        with trio.move_on_after(c.settle_bound):
            await self.decoder.wait_settled(range(c.decode_blocks))
        unsettled = self.decoder.unsettled_blocks()
        late = sorted(self.quarantined - unsettled)
        self.blocks.free(late, "settled after its wait_settled bound")
        stranded_blocks = c.decode_blocks - self.blocks.free_count
        if stranded_blocks:
            self.ledger.note(
                f"stranded decode blocks: {stranded_blocks} not back in the pool "
                f"({len(unsettled)} unsettled after {c.settle_bound:g} s with every link up)"
            )
        # Every exposure resolves within the drain bound: poll until none is
        # pending, and count those still pending when it has passed.
        pending: dict[str, int] = {}
        with trio.move_on_after(c.drain_bound):
            while True:
                for slot in self.slots:
                    if slot.worker is not None:
                        worker = slot.worker
                        try:
                            ok, stats = await self.bounded(
                                "statistics",
                                c.worker_call_bound,
                                slot.engine_id,
                                functools.partial(self.worker_call, worker.statistics),
                            )
                        except WorkerError as exc:
                            self.unexpected(f"statistics of {slot.engine_id}", exc)
                            ok = False
                        pending[slot.engine_id] = stats["exposures_pending"] if ok else 0
                if not any(pending.values()):
                    break
                await trio.sleep(0.25)
        stranded = sum(pending.values())
        for engine_id, count in pending.items():
            if count:
                self.ledger.note(
                    f"stranded exposures: {count} still pending on {engine_id} "
                    f"{c.drain_bound:g} s after the last request"
                )
        return stranded, stranded_blocks


class CountingHandler(logging.Handler):
    """Counts trio_pd's log records by level; keeps the first errors."""

    def __init__(self, echo: bool) -> None:
        super().__init__()
        self.levels: Counter[str] = Counter()
        self.errors: list[str] = []
        self.echo = echo

    def emit(self, record: logging.LogRecord) -> None:
        self.levels[record.levelname] += 1
        if record.levelno >= logging.ERROR and len(self.errors) < 20:
            self.errors.append(record.getMessage())
        if self.echo or record.levelno >= logging.ERROR:
            print(f"trio_pd {record.levelname}: {record.getMessage()}", file=sys.stderr)


async def wait_for_other_test_hosts(patience: float) -> None:
    """Wait until no other process has test hosts (at most ``patience`` seconds).

    Test hosts have fixed addresses, so only one set may exist on a machine
    at a time; another process's set (a test suite's, say) shows as network
    namespaces named ``tpd<pid>h<i>``.

    Raises:
        TestHostsUnavailable: they were still there after ``patience`` seconds.
    """
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return  # open_test_hosts says why it cannot
    others: list[str] = []
    with trio.move_on_after(patience):
        while True:
            listed = await trio.run_process(["ip", "netns", "list"], capture_stdout=True)
            names = (line.split()[0] for line in listed.stdout.decode().splitlines() if line)
            waiting = not others
            others = sorted(n for n in names if n.startswith("tpd"))
            if not others:
                return
            if waiting:
                print(f"soak: waiting for other test hosts to go: {' '.join(others)}", flush=True)
            await trio.sleep(2)
    raise TestHostsUnavailable(f"other test hosts stayed for {patience:g} s: {' '.join(others)}")


async def run_soak(config: SoakConfig, seed: int, log: CountingHandler) -> dict[str, Any]:
    """The whole soak; returns its result (see ``main`` for the exit status)."""
    await wait_for_other_test_hosts(config.wait_for_hosts)
    rng = random.Random(seed)
    secret = secrets.token_bytes(32)
    started_wall = time.time()
    async with open_test_hosts(config.hosts) as hosts:
        if config.slow_link:
            await hosts[-1].limit_rate(config.slow_link)
        kv = [
            torch.zeros((config.decode_blocks, config.block_bytes // 2), dtype=torch.float16)
            for _ in range(config.regions)
        ]
        links_before = [h.link_bytes() for h in hosts]
        # After the links exist: UCX reads the routing table once per process.
        async with trio_pd.open_connector(
            "soak-decoder", kv, config=config.connector_config(secret)
        ) as decoder:
            slots = [Slot(i, h, f"prefill-{i}") for i, h in enumerate(hosts)]
            soak = Soak(config, seed, slots, decoder, DecodeBlocks(kv), secret)
            async with trio.open_nursery() as producers:
                for slot in slots:
                    await producers.start(soak.run_slot, slot, random.Random(rng.random()))
                gc.collect()
                gc.freeze()
                print(f"soak: {len(slots)} producers up; running {config.seconds:g} s", flush=True)
                async with trio.open_nursery() as watchers:
                    soak.watchers = watchers
                    soak.started_at = trio.current_time()
                    async with trio.open_nursery() as work, trio.open_nursery() as chaos:
                        chaos.start_soon(soak.killer, random.Random(rng.random()))
                        chaos.start_soon(soak.cutter, random.Random(rng.random()))
                        for _ in range(config.clients):
                            work.start_soon(soak.client, random.Random(rng.random()))
                        for _ in range(config.forgers):
                            work.start_soon(soak.forger, random.Random(rng.random()))
                        chaos.start_soon(progress, soak)
                        await trio.sleep(config.seconds)
                        soak.stopping = True
                        chaos.cancel_scope.cancel()  # (a cut is restored on the way out)
                    run_seconds = trio.current_time() - soak.started_at
                    print(f"soak: {run_seconds:.1f} s run; draining", flush=True)
                    stranded_exposures, stranded_blocks = await soak.drain()
                    watchers.cancel_scope.cancel()
                soak.blocks.scan_free()
                stats = attrs.asdict(decoder.statistics())
                soak.shutting_down = True
                for slot in slots:
                    slot.stop.set()
        links_after = [h.link_bytes() for h in hosts]
    ledger = soak.ledger
    zero = ledger.must_be_zero(stranded_exposures, stranded_blocks, len(soak.blocks.late))
    for line in soak.blocks.late[:20]:
        ledger.note(f"late write: {line}")
    seconds = np.asarray(ledger.pull_seconds or [math.nan])
    counts = ledger.counts
    return {
        "date": datetime.datetime.fromtimestamp(started_wall).isoformat(timespec="seconds"),
        "seed": seed,
        "machine": machine(),
        "command": "python " + " ".join(sys.argv),
        "run_seconds": round(run_seconds, 1),
        "config": attrs.asdict(config),
        "bounds_s": {
            "pull": config.pull_bound,
            "abandon, hold exit": config.abandon_bound,
            "wait_released (from expose)": config.released_bound,
            "wait_settled": config.settle_bound,
            "fault aftermath": config.aftermath,
            "drain": config.drain_bound,
        },
        "must_be_zero": zero,
        "ok": not any(zero.values()),
        "pulls": {
            "succeeded": counts["pulls_succeeded"],
            "per_second": round(counts["pulls_succeeded"] / run_seconds, 1),
            "MB_per_second": round(counts["bytes_pulled"] / run_seconds / 1e6, 2),
            "p50_ms": round(float(np.percentile(seconds, 50)) * 1e3, 1),
            "p99_ms": round(float(np.percentile(seconds, 99)) * 1e3, 1),
            "max_ms": round(float(seconds.max()) * 1e3, 1),
            "cancelled": counts["pulls_cancelled"],
            "ended_unsettled": counts["pulls_unsettled"],
            "read_but_expired_in_a_fault": counts["read_but_expired_in_a_fault"],
            "read_after_its_lease_ran_out": counts["read_after_its_lease_ran_out"],
        },
        "expected_failures": {
            k: v
            for k, v in sorted(ledger.failures.items())
            if k.startswith((f"{KILLED}:", f"{CUT}:"))
        },
        "modes": {k[6:]: v for k, v in sorted(counts.items()) if k.startswith("mode: ")},
        "faults": {
            "producer kills": counts["producer_kills"],
            "producer starts": counts["producer_starts"],
            "producer starts during a cut": counts["producer_starts_in_cut"],
            "link cuts": counts["link_cuts"],
            "seconds cut": round(counts["link_cut_ms"] / 1e3, 1),
        },
        "forged": dict(sorted(ledger.forged.items())),
        "hangs": dict(ledger.hangs),
        "findings": dict(ledger.findings),
        "exposures": {"exposed": counts["exposed"], **dict(sorted(ledger.outcomes.items()))},
        "counts": dict(sorted(counts.items())),
        "link_MB": [
            round((a - b) / 1e6, 1) for a, b in zip(links_after, links_before, strict=True)
        ],
        "decoder": {k: v for k, v in stats.items() if isinstance(v, int) and v},
        "trio_pd_log": dict(log.levels),
        "notes": ledger.notes,
    }


async def progress(soak: Soak) -> None:
    """A line every 30 s, so that a long run shows it is alive."""
    while True:
        await trio.sleep(30)
        c = soak.ledger.counts
        print(
            f"soak: t={soak.now():.0f} s: {c['pulls_succeeded']} pulls, "
            f"{c['producer_kills']} kills, {c['link_cuts']} cuts, "
            f"{sum(soak.ledger.failures.values())} failed, hangs {sum(soak.ledger.hangs.values())}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=None, help="default: a random one (printed)")
    parser.add_argument("--clients", type=int, default=SoakConfig().clients)
    parser.add_argument("--forgers", type=int, default=SoakConfig().forgers)
    parser.add_argument(
        "--kill-every", type=float, default=SoakConfig().kill_every, help="mean s between kills"
    )
    parser.add_argument(
        "--cut-every", type=float, default=SoakConfig().cut_every, help="mean s between cuts"
    )
    parser.add_argument(
        "--wait-for-hosts",
        type=float,
        default=SoakConfig().wait_for_hosts,
        help="how long to wait for another process's test hosts to go",
    )
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument(
        "--markdown", type=Path, help="put the result in this page (docs/performance.md)"
    )
    parser.add_argument("--verbose", action="store_true", help="echo trio_pd's warnings")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else secrets.randbelow(2**32)
    print(f"soak: seed {seed}", flush=True)
    # The decoder (this process) reads over TCP, as the workers do.
    os.environ["UCX_TLS"] = "tcp"
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    log = CountingHandler(args.verbose)
    logger = logging.getLogger("trio_pd")
    logger.addHandler(log)
    logger.setLevel(logging.INFO if args.verbose else logging.WARNING)
    logger.propagate = False
    config = SoakConfig(
        seconds=args.seconds,
        clients=args.clients,
        forgers=args.forgers,
        kill_every=args.kill_every,
        cut_every=args.cut_every,
        wait_for_hosts=args.wait_for_hosts,
    )
    try:
        result = trio.run(run_soak, config, seed, log)
    except TestHostsUnavailable as exc:
        print(f"soak: cannot run: {exc}", flush=True)
        sys.exit(UNAVAILABLE)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    if args.markdown:
        from render_performance import replace_soak_section

        args.markdown.write_text(replace_soak_section(args.markdown.read_text(), result))
    if not result["ok"]:
        bad = {k: v for k, v in result["must_be_zero"].items() if v}
        sys.exit(f"soak: FAILED, seed {seed}: {bad}")
    print(f"soak: OK, seed {seed}: every must-be-zero count is 0 ({', '.join(MUST_BE_ZERO)})")


if __name__ == "__main__":
    main()
