"""The consumer's table of remote engine ranks, and each one's attempt event.

:class:`RemoteEngine` joins a remote engine rank's sans-IO record
(``_remote_engine.EngineRecord``) to the trio side of its handshakes (the current
attempt's Event and deadline, the loaded agent); :class:`RemoteEngines` is
the table of them, keyed by where requests say each engine is, bounded, and
asked which state an engine is in; :class:`AttemptDone` is the event of one
handshake attempt, which the engine's pulls wait on (a lighter
``trio.Event`` that drops cancelled waiters). ``_handshakes`` owns and
changes all of them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import attrs
import trio

from trio_pd._core._public_values import RemoteBlocks
from trio_pd._core._remote_engine import EngineRecord, EngineState
from trio_pd._core._tensor_parallel import PullPart
from trio_pd._transfer._backend import RemoteAgent

MAX_RECORDS = 4096
"""Remote engine records kept before idle ones (never answered, in backoff) are
forgotten. Records with an attempt in flight or an agent are kept: while more
than this are, idle ones are forgotten once the table has doubled since the
last look (so a storm of engines costs each new record constant work, and
the table holds at most twice the records in use)."""


class AttemptDone:
    """Set when one handshake attempt ends, either way; wakes the pulls waiting on it.

    A :class:`trio.Event` that costs a waiter less: a storm parks one pull
    per engine on its attempt at once, and ``trio.Event.wait`` gives each
    a closure (two cells and a function: about 300 bytes) and a set slot.
    Here a waiter is a list entry; on cancellation it stays there, marked
    gone by trio itself, which resets ``Task.custom_sleep_data`` whenever
    it reschedules a task (documented in ``trio.lowlevel.Task``). The list
    drops those entries whenever it has doubled since it last did, so pulls
    cancelled while the attempt runs on cost no memory past that.
    """

    __slots__ = ("_compact_at", "_flag", "_waiters")

    def __init__(self) -> None:
        self._flag = False
        self._waiters: list[trio.lowlevel.Task] | None = None  # (from the first waiter)
        self._compact_at = _FIRST_COMPACTION

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        """Wake every waiter (once; later calls do nothing)."""
        if self._flag:
            return
        self._flag = True
        waiters, self._waiters = self._waiters or [], None
        for task in waiters:
            if task.custom_sleep_data is self:  # (still waiting here: not cancelled)
                trio.lowlevel.reschedule(task)  # (which resets custom_sleep_data)

    async def wait(self) -> None:
        """Return once set (a checkpoint either way)."""
        if self._flag:
            await trio.lowlevel.checkpoint()
            return
        task = trio.lowlevel.current_task()
        task.custom_sleep_data = self
        if self._waiters is None:
            self._waiters = []
        elif len(self._waiters) >= self._compact_at:
            self._waiters = [t for t in self._waiters if t.custom_sleep_data is self]
            self._compact_at = max(_FIRST_COMPACTION, 2 * len(self._waiters))
        self._waiters.append(task)
        await trio.lowlevel.wait_task_rescheduled(_abort_wait)


_FIRST_COMPACTION = 64
"""An :class:`AttemptDone` drops its cancelled waiters once it has this many entries."""


def _abort_wait(_: trio.lowlevel.RaiseCancelT) -> trio.lowlevel.Abort:
    # (the task stays in the waiters' list; trio resets its custom_sleep_data)
    return trio.lowlevel.Abort.SUCCEEDED


NO_ATTEMPT = AttemptDone()
"""A record's ``attempt_done`` while no attempt is in progress (set: nothing to wait for)."""
NO_ATTEMPT.set()

EngineKey = tuple[str, str, int, int, int]
"""(engine id, host, port, TP size, rank): where a request says a remote rank is."""


@attrs.define(eq=False)
class RemoteEngine:
    """One remote engine: its sans-IO record and the trio side of its handshakes.

    Attributes:
        record: the state machine (the outcome of every attempt lives there).
        attempt_done: set when the current attempt ends, either way; a new
            attempt gets a new event, so a waiter keeps the one it waited on.
            Between attempts, :data:`NO_ATTEMPT` (one event, set, for every
            record: an idle record holds no event of its own).
        part: what this rank reads of that remote rank, and where it lands
            (from the latest request's TP sizes).
        remote_tp: the remote engine's TP size, as this record's requests say.
        agent: the loaded remote agent while the record is ``READY`` (or
            ``VERIFYING``).
        deadline: when the current attempt must be over (trio's clock):
            ``handshake_timeout`` after it started, fetch, queue and load
            together.
    """

    record: EngineRecord
    part: PullPart
    remote_tp: int = 1
    attempt_done: AttemptDone = NO_ATTEMPT
    agent: RemoteAgent | None = None
    deadline: float = 0.0

    @property
    def rank_label(self) -> str:
        """``"remote rank r: "`` for a rank of a tensor-parallel engine, else ``""``."""
        return f"remote rank {self.part.remote_rank}: " if self.remote_tp > 1 else ""


class RemoteEngines(Mapping[EngineKey, RemoteEngine]):
    """The remote engine ranks a consumer has records of, keyed by :data:`EngineKey`.

    Keyed by everything a request claims about where the engine is: each
    remote rank is its own agent and record, and so is every address a
    request names. Bounded: requests may name any engine or address, so past
    :data:`MAX_RECORDS` the idle records are forgotten (see :meth:`get_or_create`;
    at most twice the records in use are held).
    Read-only as a mapping; records are added by :meth:`get_or_create` only.
    """

    def __init__(self) -> None:
        self._by_key: dict[EngineKey, RemoteEngine] = {}
        self._forget_at = MAX_RECORDS  # (the size at which idle records are looked for)

    def __getitem__(self, key: EngineKey) -> RemoteEngine:
        return self._by_key[key]

    def __iter__(self) -> Iterator[EngineKey]:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)

    def get_or_create(
        self, remote: RemoteBlocks, part: PullPart, *, verify_interval: float
    ) -> RemoteEngine:
        """The record of the remote rank ``part`` reads, at the address and TP
        size ``remote`` names (created on first use, after forgetting idle
        records if there are :data:`MAX_RECORDS`).

        Keyed by everything a request claims about where the engine is: a
        request that names a wrong host, port or TP size gets a record of its
        own, whose handshake fails (its own request only), and never changes
        the record that valid requests use.
        """
        port = remote.port + part.remote_rank
        key = (remote.engine_id, remote.host, port, remote.tp_size, part.remote_rank)
        engine = self._by_key.get(key)
        if engine is None:
            self._forget_idle_records()
            record = EngineRecord(
                remote.engine_id,
                remote.host,
                port,
                rank=part.remote_rank,
                verify_interval=verify_interval,
            )
            engine = self._by_key[key] = RemoteEngine(record, part, remote.tp_size)
        return engine

    def _forget_idle_records(self) -> None:
        """Past :data:`MAX_RECORDS`, forget the records in backoff or never answered.

        If too few are idle, the next look is once the table has doubled: a
        look costs a pass over every record, and a storm of engines in flight
        would otherwise pay one per new record (quadratic).
        """
        if len(self._by_key) < max(MAX_RECORDS, self._forget_at):
            return
        idle = (EngineState.UNKNOWN, EngineState.BACKOFF, EngineState.CLOSED)
        for key in [k for k, e in self._by_key.items() if e.record.state in idle]:
            del self._by_key[key]
        self._forget_at = 2 * len(self._by_key)

    def _records_of(self, engine_id: str, tp_rank: int | None) -> list[RemoteEngine]:
        found = [
            e
            for (eid, _h, _p, _tp, rank), e in self._by_key.items()
            if eid == engine_id and (tp_rank is None or rank == tp_rank)
        ]
        if tp_rank is None and found:
            lowest = min(e.part.remote_rank for e in found)
            found = [e for e in found if e.part.remote_rank == lowest]
        return found

    def engine_state(self, engine_id: str, tp_rank: int | None = None) -> EngineState:
        """The state of ``engine_id`` (rank ``tp_rank``, default the lowest read).

        If requests named it at several addresses or TP sizes, the record in
        service wins (``READY`` or ``VERIFYING``), else the latest.
        """
        found = self._records_of(engine_id, tp_rank)
        if not found:
            return EngineState.UNKNOWN
        in_service = (EngineState.READY, EngineState.VERIFYING)
        serving = [e for e in found if e.record.state in in_service]
        return (serving or found)[-1].record.state

    def ready_count(self) -> int:
        """Remote engine ranks ready for pulls now."""
        return sum(1 for e in self._by_key.values() if e.record.state is EngineState.READY)

    def ranks_of(
        self, engine_id: str, host: str, tp_size: int, base_port: int
    ) -> list[tuple[int, RemoteEngine]]:
        """``(rank, record)`` of every rank of the engine at ``host``, base port
        ``base_port`` and TP size ``tp_size`` (other addresses or TP sizes are
        other engines)."""
        return [
            (rank, engine)
            for (eid, h, port, tp, rank), engine in self._by_key.items()
            if (eid, h, tp, port - rank) == (engine_id, host, tp_size, base_port)
        ]
