"""The consumer's state per remote engine rank, and its counters (no I/O).

:class:`RemoteEngine` joins a remote engine rank's sans-IO record
(``_engines.EngineRecord``) to the trio side of its handshakes (the current
attempt's Event and deadline, the loaded agent); :class:`ConsumerCounters`
is what the handshakes and the pulls count into. ``_handshakes`` owns and
changes both.
"""

from __future__ import annotations

from collections import Counter

import attrs
import trio

from ._backend import RemoteAgent
from ._engines import EngineRecord, FailureCause
from ._tp import PullPart


@attrs.define(eq=False)
class RemoteEngine:
    """One remote engine: its sans-IO record and the trio side of its handshakes.

    Attributes:
        record: the state machine (the outcome of every attempt lives there).
        attempt_done: set when the current attempt ends, either way; a new
            attempt gets a new event, so a waiter keeps the one it waited on.
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
    attempt_done: trio.Event = attrs.field(factory=trio.Event)
    agent: RemoteAgent | None = None
    deadline: float = 0.0

    @property
    def rank_label(self) -> str:
        """``"remote rank r: "`` for a rank of a tensor-parallel engine, else ``""``."""
        return f"remote rank {self.part.remote_rank}: " if self.remote_tp > 1 else ""


@attrs.define
class ConsumerCounters:
    """The consumer's counters (the handshakes and the pulls count into one)."""

    handshakes_started: int = 0
    handshakes_succeeded: int = 0
    handshake_failures: Counter[FailureCause] = attrs.field(factory=Counter)
    pulls_succeeded: int = 0
    pulls_failed: int = 0
    pulls_rejected: int = 0
    pulls_rejected_in_backoff: int = 0
    restarts_detected: int = 0
    peers_disconnected: int = 0
    bytes_pulled: int = 0
