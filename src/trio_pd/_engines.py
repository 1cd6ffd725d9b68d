"""The life cycle of a remote engine, as seen by a consumer (no I/O).

Every rule is in :data:`TRANSITIONS`; the docs draw the state diagram from
that table, so picture and code cannot drift. Everything that decides
what a pull does -- start a handshake, wait, fail fast, detect a restart,
refuse blocks of a gone incarnation -- is a method of :class:`EngineRecord`
that returns an action; the trio shell in ``_consumer.py`` only carries the
actions out, pairing each record with a :class:`trio.Event` per handshake
attempt. This module knows nothing of trio and takes the time as an argument.
"""

from __future__ import annotations

import enum
import random
from typing import Final

import attrs

from ._errors import HandshakeError
from ._layout import KVLayout
from ._protocol import EngineMetadata


class EngineState(enum.Enum):
    """Where a remote engine's handshake stands."""

    UNKNOWN = "unknown"
    """Never seen; the first pull starts a handshake."""
    FETCHING = "fetching"
    """Waiting for a fetch slot or for the metadata reply."""
    LOADING = "loading"
    """Metadata received; queued for, or in, the handshake task (NIXL calls)."""
    READY = "ready"
    """Remote agent loaded and descriptor list prepared; pulls go straight through."""
    BACKOFF = "backoff"
    """The last handshake failed; pulls fail fast with its error until the
    backoff elapses, and the first pull after that retries."""
    STALE = "stale"
    """The engine restarted or its connection died; its old agent is being
    removed, and the next pull starts a fresh handshake."""
    CLOSED = "closed"
    """The connector closed; the engine's NIXL state is released."""


class EngineEvent(enum.Enum):
    """What can happen to a remote engine."""

    PULL = "pull"
    PULL_DURING_BACKOFF = "pull during backoff"
    PULL_AFTER_BACKOFF = "pull after backoff"
    METADATA_RECEIVED = "metadata received"
    LOADED = "loaded"
    FAILED = "failed"
    PEER_RESTARTED = "peer restarted"
    PEER_DISCONNECTED = "peer disconnected"
    CONNECTOR_CLOSED = "connector closed"


S, E = EngineState, EngineEvent

TRANSITIONS: Final[dict[tuple[EngineState, EngineEvent], EngineState]] = {
    (S.UNKNOWN, E.PULL): S.FETCHING,
    (S.STALE, E.PULL): S.FETCHING,
    (S.BACKOFF, E.PULL_AFTER_BACKOFF): S.FETCHING,
    (S.BACKOFF, E.PULL_DURING_BACKOFF): S.BACKOFF,
    (S.FETCHING, E.METADATA_RECEIVED): S.LOADING,
    (S.FETCHING, E.FAILED): S.BACKOFF,
    (S.LOADING, E.LOADED): S.READY,
    (S.LOADING, E.FAILED): S.BACKOFF,
    (S.READY, E.PEER_RESTARTED): S.STALE,
    (S.READY, E.PEER_DISCONNECTED): S.STALE,
    **{(state, E.CONNECTOR_CLOSED): S.CLOSED for state in EngineState if state is not S.CLOSED},
}
"""Every allowed (state, event) -> next state. Anything else is a bug."""


class InvalidTransition(RuntimeError):
    """A transition not in :data:`TRANSITIONS` was attempted: a trio_pd bug."""


class PullAction(enum.Enum):
    """What a pull must do next (see :meth:`EngineRecord.on_pull`)."""

    START = "start"
    """A new handshake attempt began: start fetching, then wait for it."""
    RETIRE_THEN_START = "retire then start"
    """The request names a newer incarnation than the loaded one: the engine
    restarted. Retire the loaded agent, then do as for ``START``."""
    WAIT = "wait"
    """An attempt is in progress: wait for it, then ask again."""
    READY = "ready"
    """The loaded agent serves this request: transfer now."""
    FAIL_FAST = "fail fast"
    """In backoff: raise the last error (:attr:`EngineRecord.error`) now."""
    GONE = "gone"
    """The request's blocks belong to an incarnation that no longer runs:
    fail it without reading (:meth:`EngineRecord.why_gone` says why)."""


class FailureCause(enum.StrEnum):
    """Why a handshake failed: the keys of ``handshake_failures_by_cause`` in
    :class:`~trio_pd.ConnectorStatistics` (a ``str`` enum: each member equals its value)."""

    TIMEOUT = "timeout"
    """No usable reply within ``handshake_timeout``."""
    REFUSED = "refused"
    """Side-channel authentication refused (or no key for the producer)."""
    PROTOCOL = "protocol"
    """The reply could not be decoded or broke the protocol."""
    INCOMPATIBLE = "incompatible"
    """The engines cannot be paired (:class:`~trio_pd.IncompatibleEngineError`)."""
    NIXL = "nixl"
    """The transfer backend (NIXL) could not load the remote agent in time."""


@attrs.frozen
class Backoff:
    """Exponential, jittered, capped delays between handshake attempts.

    The n-th consecutive failure waits ``min(maximum, initial * 2**(n-1))``
    scaled by a random factor in ``[1 - jitter, 1]``.
    """

    initial: float = 1.0
    maximum: float = 30.0
    jitter: float = 0.2

    def delay(self, failures: int, rng: random.Random) -> float:
        base = min(self.maximum, self.initial * 2.0 ** max(0, failures - 1))
        return base * (1.0 - self.jitter * rng.random())


@attrs.define
class EngineRecord:
    """What a consumer knows about one remote engine.

    Attributes:
        engine_id: the remote engine's id.
        host: its side-channel host.
        port: its side-channel port.
        state: see :class:`EngineState`.
        error: the last handshake's error (kept through ``BACKOFF``).
        metadata: the current incarnation's metadata once received.
        layout: the layout that metadata describes.
        attempts: handshakes started for this engine.
        failures: consecutive failed handshakes (reset by success).
        retry_at: while ``BACKOFF``, when the next attempt is allowed.
        retired_incarnations: incarnations seen and replaced (the engine
            restarted since): their blocks are gone for good.
        sought_incarnation: the incarnation the pull that started the current
            attempt asked for (``""``: any).
        epoch: the incarnation that requests name when they are for what is
            loaded: the loaded incarnation for an engine's rank 0 (and for
            engines without tensor parallelism); for another rank, the rank-0
            incarnation its requests named when it was loaded (requests carry
            rank 0's incarnation, as a vLLM proxy forwards rank 0's
            ``kv_transfer_params``; the ranks of an engine restart together).
    """

    engine_id: str
    host: str
    port: int
    state: EngineState = EngineState.UNKNOWN
    error: HandshakeError | None = None
    metadata: EngineMetadata | None = None
    layout: KVLayout | None = None
    attempts: int = 0
    failures: int = 0
    retry_at: float = 0.0
    retired_incarnations: set[str] = attrs.field(factory=set)
    sought_incarnation: str = ""
    epoch: str = ""

    @property
    def incarnation(self) -> str | None:
        """The incarnation of the loaded metadata (``None`` before the first)."""
        return None if self.metadata is None else self.metadata.incarnation

    def apply(self, event: EngineEvent) -> EngineState:
        """Move to the state :data:`TRANSITIONS` gives; raise if none."""
        try:
            new = TRANSITIONS[self.state, event]
        except KeyError:
            raise InvalidTransition(
                f"engine {self.engine_id!r}: {event.value!r} in state {self.state.value!r}"
            ) from None
        if new is EngineState.FETCHING:
            self.attempts += 1
        self.state = new
        return new

    def on_pull(self, incarnation: str, host: str, port: int, now: float) -> PullAction:
        """Account for a pull and say what it must do; the whole policy is here.

        Args:
            incarnation: the incarnation that exposed the request's blocks
                (``""`` when the producer does not say).
            host, port: where the request says the engine listens. Adopted
                when a new attempt starts; ignored while an attempt is under
                way or the engine is ready (the shell may log the mismatch).
            now: the current time (any clock, used for backoff only).
        """
        if incarnation and incarnation in self.retired_incarnations:
            return PullAction.GONE
        action = PullAction.START
        if self.state is EngineState.READY:
            if not self.epoch:
                self.epoch = incarnation  # a rank > 0 loaded for a request without one
            if not incarnation or incarnation == self.epoch:
                return PullAction.READY
            self.went_stale(EngineEvent.PEER_RESTARTED)
            action = PullAction.RETIRE_THEN_START
        elif self.state in (EngineState.FETCHING, EngineState.LOADING):
            return PullAction.WAIT
        elif self.state is EngineState.BACKOFF:
            if now < self.retry_at:
                self.apply(EngineEvent.PULL_DURING_BACKOFF)
                return PullAction.FAIL_FAST
            self.apply(EngineEvent.PULL_AFTER_BACKOFF)
            self._begin_attempt(incarnation, host, port)
            return action
        self.apply(EngineEvent.PULL)
        self._begin_attempt(incarnation, host, port)
        return action

    def _begin_attempt(self, incarnation: str, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.sought_incarnation = incarnation

    def attempt_error(self, attempt: int) -> HandshakeError | None:
        """The error of handshake ``attempt`` if it is the latest and failed.

        A pull that waited on ``attempt`` raises this; ``None`` means "ask
        :meth:`on_pull` again" (it succeeded, or a later attempt took over).
        """
        if attempt == self.attempts and self.state is EngineState.BACKOFF:
            return self.error
        return None

    def why_gone(self, incarnation: str) -> str:
        """Why blocks of ``incarnation`` cannot be read (after ``GONE``)."""
        current = self.epoch
        if self.state is EngineState.READY and current and current != incarnation:
            running = f"which now runs incarnation {current}"
        else:
            running = "which no longer runs it"
        return (
            f"the blocks were exposed by incarnation {incarnation} of engine "
            f"{self.engine_id!r}, {running}: it restarted and the blocks are gone"
        )

    def on_peer_lost(self, incarnation: str) -> bool:
        """A transfer to ``incarnation`` reported its peer lost.

        Returns whether the shell must retire the loaded agent: only when that
        incarnation is the loaded one and the engine is ``READY`` (otherwise
        another pull already noticed). The incarnation is not retired: the
        engine may have died, restarted, or lost a link. The next pull
        handshakes again and finds out; its blocks are read only if the same
        incarnation answers.
        """
        if self.state is not EngineState.READY or incarnation != self.incarnation:
            return False
        self.apply(EngineEvent.PEER_DISCONNECTED)
        return True

    def went_stale(self, event: EngineEvent) -> None:
        """``PEER_RESTARTED``: the loaded incarnation (epoch) is over for good."""
        self.apply(event)
        if self.epoch:
            self.retired_incarnations.add(self.epoch)

    def metadata_received(self, metadata: EngineMetadata, layout: KVLayout) -> None:
        """The reply of the current attempt arrived and checked out.

        If the pull that started the attempt wanted another incarnation than
        the one that answered, that incarnation no longer runs: it is retired,
        so its requests fail ``GONE`` instead of handshaking again.
        """
        self.apply(EngineEvent.METADATA_RECEIVED)
        self.metadata = metadata
        self.layout = layout
        if metadata.tp_rank:  # requests name rank 0's incarnation: nothing to compare
            self.epoch = self.sought_incarnation
            return
        self.epoch = metadata.incarnation
        self.retired_incarnations.discard(metadata.incarnation)
        sought = self.sought_incarnation
        if sought and sought != metadata.incarnation:
            self.retired_incarnations.add(sought)

    def loaded(self) -> None:
        self.apply(EngineEvent.LOADED)
        self.failures = 0
        self.error = None

    def failed(
        self, error: HandshakeError, now: float, backoff: Backoff, rng: random.Random
    ) -> float:
        """Enter ``BACKOFF`` after ``error``; return the delay before a retry."""
        self.apply(EngineEvent.FAILED)
        self.error = error
        self.metadata = None
        self.layout = None
        self.failures += 1
        delay = backoff.delay(self.failures, rng)
        self.retry_at = now + delay
        return delay
