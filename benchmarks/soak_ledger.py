"""The soak's bookkeeping (no network, no processes): bounds, faults, blocks, counts.

``soak.py`` drives real engines; everything it concludes goes through here:

* :class:`SoakConfig`: the connector's deadlines and the bound of every
  operation the soak waits on, derived from them as ``docs/timeouts.md``
  composes them.
* :class:`FaultTimeline`: when each producer was killed, each link cut and
  restored, each forged request in flight. A failed valid request is
  *classified* against it (:meth:`FaultTimeline.classify`): its producer
  was killed, or its link cut, in the request's window; otherwise the
  failure is unexplained (or, if a forged request was in flight at that
  engine, blamed on the forgery). Nothing is excused by its error type.
* :class:`DecodeBlocks`: the decoder's block pool. Freed blocks are filled
  with a sentinel; a block handed out again must still hold it, or
  something wrote it after its pull ended (a *late write*).
* :class:`ProducerBlocks`: one producer incarnation's pool: a block is
  reused only once its exposure resolved *and* the consumer side is done
  with it.
* :class:`Ledger`: the counts, and which of them must be zero.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

import attrs
import numpy as np
import trio

import trio_pd
from trio_pd._consumer._handshakes import HANDSHAKES_PER_PULL
from trio_pd._harness._seeded_blocks import block_bytes
from trio_pd.testing import expected_blocks

SENTINEL = 0xA5
"""What a free decode block holds, every byte (random payloads never do, all 16 KiB)."""


@attrs.frozen(kw_only=True)
class SoakConfig:
    """The run's shape, the connector's deadlines, and the bound of each operation.

    Bounds (seconds) are what the documentation promises, plus ``slack``
    for a loaded 2-core machine: an operation past its bound is a *hang*.
    """

    seconds: float = 600.0
    hosts: int = 2
    clients: int = 24
    forgers: int = 2
    regions: int = 4
    block_bytes: int = 4096  # per region: 16 KiB per block
    decode_blocks: int = 2048
    producer_blocks: int = 1024
    pull_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    pull_size_weights: tuple[int, ...] = (8, 6, 5, 4, 3, 2, 1)
    slow_link: str = "200mbit"
    """The last host's link rate (the others are unlimited): pulls there take
    long enough for cancellations and cuts to land mid-transfer."""
    kill_every: float = 20.0
    """Mean seconds between producer kills (exponential gaps)."""
    restart_after: tuple[float, float] = (0.2, 2.0)
    cut_every: float = 12.0
    """Mean seconds between link cuts (exponential gaps)."""
    cut_for: tuple[float, float] = (1.0, 6.0)
    cancel_after: tuple[float, float] = (0.0, 0.05)
    hold_for: tuple[float, float] = (0.0, 0.5)
    long_hold_for: tuple[float, float] = (7.5, 10.0)
    """A long hold outlasts ``lease_initial``: only its renewals keep the exposure."""
    slack: float = 2.0
    settle_slack: float = 15.0
    port: int = 5600
    wait_for_hosts: float = 900.0
    """How long to wait for another process's test hosts to go before starting."""
    handshake_timeout: float = 2.0
    transfer_timeout: float = 4.0
    close_timeout: float = 2.0
    lease_initial: float = 6.0
    lease_renewal: float = 3.0
    heartbeat_interval: float = 1.0
    abort_timeout: float = 30.0
    backoff_initial: float = 0.2
    backoff_max: float = 1.0

    def connector_config(self, secret: bytes) -> trio_pd.ConnectorConfig:
        return trio_pd.ConnectorConfig(
            handshake_timeout=self.handshake_timeout,
            transfer_timeout=self.transfer_timeout,
            close_timeout=self.close_timeout,
            lease_initial=self.lease_initial,
            lease_renewal=self.lease_renewal,
            heartbeat_interval=self.heartbeat_interval,
            abort_timeout=self.abort_timeout,
            backoff_initial=self.backoff_initial,
            backoff_max=self.backoff_max,
            exposure_secret=secret,
        )

    @property
    def pull_bound(self) -> float:
        """A pull: each handshake wait ends within ``handshake_timeout`` of its start
        (fetch), the load gets as much again, and a pull waits on at most
        ``HANDSHAKES_PER_PULL`` of them (a restart's verification, then the new
        incarnation); then ``transfer_timeout``, then ``close_timeout`` to stop."""
        handshakes = HANDSHAKES_PER_PULL * 2 * self.handshake_timeout
        return handshakes + self.transfer_timeout + self.close_timeout + self.slack

    def cancelled_pull_bound(self, delay: float) -> float:
        """A pull cancelled after ``delay``: its running transfers get ``close_timeout``."""
        return delay + self.close_timeout + self.slack

    @property
    def abandon_bound(self) -> float:
        """``Connector.abandon`` and a hold's exit: ``handshake_timeout`` per rank, at once."""
        return self.handshake_timeout + self.slack

    @property
    def released_bound(self) -> float:
        """``wait_released`` from ``expose``: never past ``abort_timeout``."""
        return self.abort_timeout + self.slack

    @property
    def worker_call_bound(self) -> float:
        """A command to a worker over its pipe (expose, statistics): the harness's own bound."""
        return 10.0

    @property
    def settle_bound(self) -> float:
        """``wait_settled`` once the pull ended: the longest cut, then TCP's
        retransmission and the transfer's end (``transfer_timeout`` + ``close_timeout``)."""
        return self.cut_for[1] + self.transfer_timeout + self.close_timeout + self.settle_slack

    @property
    def allocate_bound(self) -> float:
        """Waiting for free decode blocks: every holder gives them back within
        a pull and a settle."""
        return self.pull_bound + self.settle_bound + self.long_hold_for[1]

    @property
    def drain_bound(self) -> float:
        """After the last request: every exposure resolves within ``lease_initial``
        of its exposure or ``lease_renewal`` of its last heartbeat."""
        return max(self.lease_initial, self.lease_renewal) + self.slack

    @property
    def aftermath(self) -> float:
        """How long a fault's effects may outlast it: a handshake attempt that began
        during it fails within ``handshake_timeout``, then its engine backs off
        for up to ``backoff_max``; plus slack."""
        return self.handshake_timeout + self.backoff_max + self.slack


# ---- the fault timeline -------------------------------------------------------------

KILLED = "producer killed"
CUT = "link cut"
FORGED = "valid request failed by a forged one"
UNEXPLAINED = "unexplained"
STARTED_IN_CUT = "producer started while its link was cut"
"""A bug the soak found, fixed since: a producer whose NIXL agent (UCX) started
while its network interface was down advertised loopback only, and no
consumer could load it for the rest of its life, link restored or not. The
connector now waits for the interface before it creates the agent
(``ConnectorConfig.interface_timeout``); this count must stay 0."""


@attrs.define
class _Down:
    """A producer killed: down from ``killed`` until its successor is ready."""

    generation: int
    killed: float
    restarted: float = math.inf


@attrs.define
class _SlotHistory:
    kills: list[_Down] = attrs.field(factory=list)
    cuts: list[list[float]] = attrs.field(factory=list)
    """[cut at, restored at] (inf while cut)"""
    forged: list[list[float]] = attrs.field(factory=list)
    """[forged request started, ended] (inf while in flight)"""
    started_in_cut: set[int] = attrs.field(factory=set)
    """Generations that started (process spawned to ready) while the link was down."""


class FaultTimeline:
    """What was done to each producer slot, and when (trio's clock).

    A slot is a test host with its producer; each start of a worker there is
    a new *generation* (a new incarnation of the engine).
    """

    def __init__(self, slots: int, aftermath: float) -> None:
        self._slots = [_SlotHistory() for _ in range(slots)]
        self.aftermath = aftermath

    def killed(self, slot: int, generation: int, when: float) -> None:
        self._slots[slot].kills.append(_Down(generation, when))

    def started(self, slot: int, generation: int, spawned: float, when: float) -> None:
        """``generation``, spawned at ``spawned``, is ready (listening) at ``when``:
        the slot's downtime, if any, ends."""
        history = self._slots[slot]
        for down in history.kills:
            down.restarted = min(down.restarted, when)
        if any(cut <= when and restored >= spawned for cut, restored in history.cuts):
            history.started_in_cut.add(generation)

    def started_in_cut(self, slot: int) -> list[int]:
        return sorted(self._slots[slot].started_in_cut)

    def cut(self, slot: int, when: float) -> list[float]:
        interval = [when, math.inf]
        self._slots[slot].cuts.append(interval)
        return interval

    def forged_started(self, slot: int, when: float) -> list[float]:
        interval = [when, math.inf]
        self._slots[slot].forged.append(interval)
        return interval

    def was_killed(self, slot: int, generation: int) -> bool:
        return any(down.generation == generation for down in self._slots[slot].kills)

    def forged_nearby(self, slot: int, started: float, ended: float) -> bool:
        """Whether a forged request to ``slot`` was in flight in the request's window."""
        since = started - self.aftermath
        return any(b <= ended and f >= since for b, f in self._slots[slot].forged)

    def classify(self, slot: int, generation: int, started: float, ended: float) -> str:
        """Why a valid request to ``slot``'s ``generation``, in flight from
        ``started`` to ``ended``, may have failed.

        * :data:`KILLED`: that generation was killed before the request ended,
          or the slot was down (from a kill until the next generation was
          ready) at some point in ``[started - aftermath, ended]`` (the
          engine's backoff and retired agent outlive the downtime);
        * :data:`CUT`: the slot's link was down at some point in
          ``[started - aftermath, ended]``;
        * :data:`STARTED_IN_CUT`: neither, but that generation started
          while the link was cut (a bug: see :data:`STARTED_IN_CUT`);
        * :data:`FORGED`: none of these, but a forged request to that slot
          was in flight in that window;
        * :data:`UNEXPLAINED`: none of these.
        """
        history = self._slots[slot]
        since = started - self.aftermath
        for down in history.kills:
            if down.killed <= ended and (down.generation == generation or down.restarted >= since):
                return KILLED
        for cut, restored in history.cuts:
            if cut <= ended and restored >= since:
                return CUT
        if generation in history.started_in_cut:
            return STARTED_IN_CUT
        return FORGED if self.forged_nearby(slot, started, ended) else UNEXPLAINED


# ---- block pools --------------------------------------------------------------------


class DecodeBlocks:
    """The decoder's blocks: handed out, given back, and checked for late writes.

    Every free block holds :data:`SENTINEL` in every byte of every region.
    :meth:`allocate` hands out the blocks freed longest ago (the most time
    for a late write to show) and checks each still holds the sentinel;
    one that does not was written after its last pull ended (and after it
    settled, when it had to): a late write.
    """

    def __init__(self, kv_caches: Sequence[Any]) -> None:
        self._views = [block_bytes(t) for t in kv_caches]
        count = self._views[0].shape[0]
        for view in self._views:
            view[:] = SENTINEL
        self._free: deque[int] = deque(range(count))
        self._changed = trio.Event()
        self.last_use: dict[int, str] = {}
        """Block id -> how its last use ended (for the report of a late write)."""
        self.late: list[str] = []
        """One line per late write found."""

    @property
    def free_count(self) -> int:
        return len(self._free)

    def _dirty(self, ids: Sequence[int]) -> list[int]:
        index = np.asarray(ids, dtype=np.int64)
        bad = np.zeros(index.size, dtype=bool)
        for view in self._views:
            bad |= (view[index] != SENTINEL).any(axis=1)
        return [int(b) for b in index[bad]]

    async def allocate(self, count: int) -> list[int]:
        """``count`` free blocks, once there are (bound it with a cancel scope)."""
        await trio.lowlevel.checkpoint()
        while len(self._free) < count:
            await self._changed.wait()
        ids = [self._free.popleft() for _ in range(count)]
        for block in self._dirty(ids):
            self.late.append(f"block {block}: {self.last_use.get(block, 'never used')}")
        return ids

    def free(self, ids: Sequence[int], how: str) -> None:
        """Give ``ids`` back (their pull ended and settled): fill with the sentinel."""
        index = np.asarray(ids, dtype=np.int64)
        for view in self._views:
            view[index] = SENTINEL
        for block in ids:
            self.last_use[block] = how
        self._free.extend(ids)
        self._changed.set()
        self._changed = trio.Event()

    def scan_free(self) -> None:
        """Check every free block now (at the end of the run)."""
        for block in self._dirty(list(self._free)):
            self.late.append(f"block {block} (final scan): {self.last_use.get(block, '-')}")

    def wrong_bytes(self, ids: Sequence[int], seed: int) -> int:
        """Bytes of ``ids`` that differ from what ``seed`` stands for."""
        index = np.asarray(ids, dtype=np.int64)
        wanted = expected_blocks(seed, [v.shape[1] for v in self._views], index.size)
        return int(sum((v[index] != w).sum() for v, w in zip(self._views, wanted, strict=True)))


class ProducerBlocks:
    """One producer incarnation's blocks, as the soak hands them to exposures.

    A block goes back once two things happened: its exposure resolved
    (``wait_released`` answered) and the consumer side is done with it
    (its pull ended and settled, or it was abandoned). So no consumer ever
    reads a block that the producer refilled for another request: any wrong
    byte is trio_pd's.
    """

    def __init__(self, count: int) -> None:
        self._free = list(range(count))
        self._waiting: dict[str, tuple[list[int], int]] = {}

    def take(self, count: int, request_id: str) -> list[int] | None:
        if len(self._free) < count:
            return None
        ids, self._free = self._free[:count], self._free[count:]
        self._waiting[request_id] = (ids, 2)
        return ids

    def done(self, request_id: str) -> None:
        """One of the two (resolved; consumer done) happened for ``request_id``."""
        ids, left = self._waiting.pop(request_id)
        if left == 1:
            self._free.extend(ids)
        else:
            self._waiting[request_id] = (ids, left - 1)


# ---- counts -------------------------------------------------------------------------

MUST_BE_ZERO = (
    "wrong_bytes",
    "late_writes",
    "hangs",
    "stranded_exposures",
    "stranded_decode_blocks",
    "valid_failed_by_forged",
    "unexplained_failures",
    "unreachable_after_start_in_cut",
    "forged_accepted",
    "unexpected_errors",
)


def note_kind(line: str) -> str:
    """What a note is about: ``"cause: operation: error"`` for a failed request's."""
    parts = line.split(": ")
    return ": ".join(parts[:3]) if len(parts) > 3 else line


@attrs.define
class Ledger:
    """Every count of the run; :data:`MUST_BE_ZERO` names the ones that must stay 0."""

    counts: Counter[str] = attrs.field(factory=Counter)
    """Flat counters (pulls, holds, faults, ...)."""
    failures: Counter[str] = attrs.field(factory=Counter)
    """Valid requests that failed, by ``cause: operation: error type``."""
    forged: Counter[str] = attrs.field(factory=Counter)
    """Forged requests, by ``kind -> error type`` (or ``ACCEPTED``)."""
    hangs: Counter[str] = attrs.field(factory=Counter)
    """Operations past their bound, by operation."""
    outcomes: Counter[str] = attrs.field(factory=Counter)
    """How exposures resolved (read, abandoned, expired, producer gone)."""
    findings: Counter[str] = attrs.field(factory=Counter)
    """Bugs found outside the connector (in ``trio_pd.testing``), by what happened."""
    notes: list[str] = attrs.field(factory=list)
    """The first examples of every must-be-zero event, for the report."""
    pull_seconds: list[float] = attrs.field(factory=list)

    def note(self, line: str) -> None:
        """Keep ``line`` for the report: the first 3 of each kind (see
        :func:`note_kind`), 50 in all."""
        kind = note_kind(line)
        if len(self.notes) < 50 and sum(note_kind(n) == kind for n in self.notes) < 3:
            self.notes.append(line)

    def hang(self, operation: str, bound: float, what: str) -> None:
        self.hangs[operation] += 1
        self.note(f"hang: {operation} ({what}) exceeded its bound of {bound:g} s")

    def must_be_zero(
        self, stranded_exposures: int, stranded_blocks: int, late: int
    ) -> dict[str, int]:
        failures = self.failures
        return {
            "wrong_bytes": self.counts["wrong_bytes"],
            "late_writes": late,
            "hangs": sum(self.hangs.values()),
            "stranded_exposures": stranded_exposures,
            "stranded_decode_blocks": stranded_blocks,
            "valid_failed_by_forged": sum(n for k, n in failures.items() if k.startswith(FORGED)),
            "unexplained_failures": sum(
                n for k, n in failures.items() if k.startswith(UNEXPLAINED)
            ),
            "unreachable_after_start_in_cut": sum(
                n for k, n in failures.items() if k.startswith(STARTED_IN_CUT)
            ),
            "forged_accepted": sum(n for k, n in self.forged.items() if k.endswith("ACCEPTED")),
            "unexpected_errors": self.counts["unexpected_errors"],
        }
