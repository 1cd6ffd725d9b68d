"""The life cycle of a remote engine, as seen by a consumer (no I/O).

Every rule is in :data:`TRANSITIONS`; the docs draw the state diagram from
that table, so picture and code cannot drift. Everything that decides
what a pull does -- start a handshake, wait, fail fast, detect a restart,
refuse blocks of a gone incarnation -- is a method of :class:`EngineRecord`
that returns an action; the trio shell (``_handshakes.py``) only carries the
actions out, pairing each record with an event (``AttemptDone``) per handshake
attempt. This module knows nothing of trio and takes the time as an argument.
"""

from __future__ import annotations

import enum
import math
import random
from typing import Final

import attrs

from trio_pd._core._errors import HandshakeError
from trio_pd._core._protocol import EngineMetadata


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
    VERIFYING = "verifying"
    """A request named another incarnation than the loaded one, and the engine is
    asked which one it runs. Pulls of the loaded incarnation still go
    straight through; the agent is retired only if the engine answers with a
    new one."""
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
    INCARNATION_MISMATCH = "incarnation mismatch"
    VERIFIED_SAME = "verified same"
    VERIFY_FAILED = "verify failed"
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
    (S.READY, E.INCARNATION_MISMATCH): S.VERIFYING,
    (S.VERIFYING, E.VERIFIED_SAME): S.READY,
    (S.VERIFYING, E.VERIFY_FAILED): S.READY,
    (S.VERIFYING, E.PEER_RESTARTED): S.LOADING,
    (S.READY, E.PEER_DISCONNECTED): S.STALE,
    (S.VERIFYING, E.PEER_DISCONNECTED): S.STALE,
    **{(state, E.CONNECTOR_CLOSED): S.CLOSED for state in EngineState if state is not S.CLOSED},
}
"""Every allowed (state, event) -> next state. Anything else is a bug."""


class InvalidTransition(RuntimeError):
    """A transition not in :data:`TRANSITIONS` was attempted: a trio_pd bug."""


class PullAction(enum.Enum):
    """What a pull must do next (see :meth:`EngineRecord.on_pull`)."""

    START = "start"
    """A new handshake attempt began: start fetching, then wait for it."""
    VERIFY = "verify"
    """The request names another incarnation than the loaded one: fetch the
    engine's metadata again (the loaded agent stays in service), then wait
    for the answer. Only an answer with a new incarnation retires the agent
    (see :meth:`EngineRecord.metadata_received`)."""
    WAIT = "wait"
    """An attempt is in progress: wait for it, then ask again."""
    DEFER = "defer"
    """The request names an incarnation the engine was not asked about, and
    a verification ran less than ``verify_interval`` ago: wait until
    :attr:`EngineRecord.verify_again_at`, then ask again (the engine may
    have restarted since; at most one verification per interval however
    many such requests come)."""
    READY = "ready"
    """The loaded agent serves this request: transfer now."""
    FAIL_FAST = "fail fast"
    """In backoff, or a verification just failed: raise
    :meth:`EngineRecord.fail_fast_error` now."""
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


RETIRED_INCARNATIONS_KEPT: Final = 256
"""How many retired or refuted incarnations a record remembers (requests can
name any string: the set must not grow without bound)."""


class MetadataOutcome(enum.Enum):
    """What an attempt's metadata means (see :meth:`EngineRecord.metadata_received`)."""

    LOAD = "load"
    """A first or fresh handshake: load the agent."""
    SAME = "same"
    """A verification found the loaded incarnation: nothing to load."""
    RESTARTED = "restarted"
    """A verification found a new incarnation: retire the loaded agent, load the new one."""


@attrs.define
class EngineRecord:
    """What a consumer knows about one remote engine rank at one address.

    Attributes:
        engine_id: the remote engine's id.
        host: its side-channel host.
        port: its side-channel port.
        state: see :class:`EngineState`.
        error: the last handshake's error (kept through ``BACKOFF``).
        incarnation: the incarnation of the metadata received last
            (``None`` before the first, and after a failed handshake). The
            rest of the metadata is the shell's: it goes to the load.
        attempts: handshakes (and verifications) started for this engine.
        failures: consecutive failed handshakes (reset by success).
        retry_at: while ``BACKOFF``, when the next attempt is allowed.
        retired_incarnations: incarnations seen and replaced (the engine
            restarted since), or named by requests and refuted by the
            engine itself: their blocks are not readable. The most recent
            :data:`RETIRED_INCARNATIONS_KEPT` are kept.
        sought_incarnation: the incarnation the pull that started the current
            attempt asked for (``""``: any).
        epoch: the incarnation that requests name when they are for what is
            loaded: the loaded incarnation (rank 0, or an engine without
            tensor parallelism); ``""`` for a record of another rank.
        rank: the remote rank this record reads. Requests carry rank 0's
            incarnation (a vLLM proxy forwards rank 0's
            ``kv_transfer_params``), which says nothing about another rank's,
            so a record of rank > 0 judges no request's incarnation: not from
            a request (a stale or forged one would poison it), and not by
            verification (the rank answers with its own). Its restarts are
            seen as lost peers, or when rank 0's record of the engine finds
            a new incarnation (an engine's ranks restart together: the shell
            retires the other ranks' agents then); and the rank-0 part of
            the same request (on whichever decode rank reads rank 0) refuses
            blocks of an incarnation that is gone.
        verify_interval: the least time between two verifications (a
            request naming an unknown incarnation costs at most one
            handshake per interval, however many such requests come).
        verify_again_at: when the next verification is allowed.
        verify_error: the last verification's error, if the engine did not
            answer it; pulls that need a verification fail fast with it
            until ``verify_again_at``.
    """

    engine_id: str
    host: str
    port: int
    state: EngineState = EngineState.UNKNOWN
    error: HandshakeError | None = None
    incarnation: str | None = None
    attempts: int = 0
    failures: int = 0
    retry_at: float = 0.0
    retired_incarnations: dict[str, None] = attrs.field(factory=dict)
    sought_incarnation: str = ""
    epoch: str = ""
    rank: int = 0
    verify_interval: float = 1.0
    verify_again_at: float = -math.inf
    verify_error: HandshakeError | None = None

    def apply(self, event: EngineEvent) -> EngineState:
        """Move to the state :data:`TRANSITIONS` gives; raise if none."""
        try:
            new = TRANSITIONS[self.state, event]
        except KeyError:
            raise InvalidTransition(
                f"engine {self.engine_id!r}: {event.value!r} in state {self.state.value!r}"
            ) from None
        if new in (EngineState.FETCHING, EngineState.VERIFYING):
            self.attempts += 1
        self.state = new
        return new

    def on_pull(self, incarnation: str, now: float) -> PullAction:
        """Account for a pull and say what it must do; the whole policy is here.

        A request's claim hurts only that request: an incarnation other than
        the loaded one starts at most one verification per
        ``verify_interval``, during which pulls of the loaded incarnation go
        on; the loaded agent is retired only if the engine itself answers
        with a new incarnation.

        Args:
            incarnation: the incarnation that exposed the request's blocks
                (``""`` when the producer does not say).
            now: the current time (any clock).
        """
        if self.rank:
            incarnation = ""  # (rank 0's: nothing to judge here, see ``rank``)
        if incarnation and incarnation in self.retired_incarnations:
            return PullAction.GONE
        state = self.state
        if state is EngineState.READY or state is EngineState.VERIFYING:
            if not incarnation or incarnation == self.epoch:
                return PullAction.READY
            if state is EngineState.VERIFYING:
                return PullAction.WAIT
            if now < self.verify_again_at:
                # Verified moments ago: the engine did not answer (fail fast),
                # or answered about another incarnation (ask again later).
                return PullAction.FAIL_FAST if self.verify_error else PullAction.DEFER
            self.apply(EngineEvent.INCARNATION_MISMATCH)
            self.sought_incarnation = incarnation
            self.verify_again_at = now + self.verify_interval
            self.verify_error = None
            return PullAction.VERIFY
        if state in (EngineState.FETCHING, EngineState.LOADING):
            return PullAction.WAIT
        if state is EngineState.BACKOFF:
            if now < self.retry_at:
                self.apply(EngineEvent.PULL_DURING_BACKOFF)
                return PullAction.FAIL_FAST
            self.apply(EngineEvent.PULL_AFTER_BACKOFF)
        else:
            self.apply(EngineEvent.PULL)
        self.sought_incarnation = incarnation
        return PullAction.START

    def fail_fast_error(self) -> HandshakeError:
        """The error a ``FAIL_FAST`` pull raises (a copy of it, by the shell)."""
        error = self.error if self.state is EngineState.BACKOFF else self.verify_error
        assert error is not None
        return error

    def attempt_error(self, attempt: int) -> HandshakeError | None:
        """The error of handshake ``attempt`` if it is the latest and failed.

        A pull that waited on ``attempt`` raises this; ``None`` means "ask
        :meth:`on_pull` again" (it succeeded, or a later attempt took over,
        or it was a verification: :meth:`on_pull` says what it found).
        """
        if attempt == self.attempts and self.state is EngineState.BACKOFF:
            return self.error
        return None

    def why_gone(self, incarnation: str) -> str:
        """Why blocks of ``incarnation`` cannot be read (after ``GONE``)."""
        current = self.epoch
        if self.state in (EngineState.READY, EngineState.VERIFYING) and current:
            return (
                f"engine {self.engine_id!r} runs incarnation {current}, not {incarnation} "
                "(it restarted since those blocks were exposed, or the parameters are "
                "wrong): the blocks are gone"
            )
        return (
            f"the blocks were exposed by incarnation {incarnation} of engine "
            f"{self.engine_id!r}, which no longer runs it: it restarted and the blocks are gone"
        )

    def on_peer_lost(self, incarnation: str) -> bool:
        """A transfer to ``incarnation`` reported its peer lost.

        Returns whether the shell must retire the loaded agent: only when that
        incarnation is the loaded one and the agent is in service
        (otherwise another pull already noticed). The incarnation is not
        retired: the engine may have died, restarted, or lost a link. The
        next pull handshakes again and finds out; its blocks are read only
        if the same incarnation answers.
        """
        if self.state not in (EngineState.READY, EngineState.VERIFYING):
            return False
        if incarnation != self.incarnation:
            return False
        self.apply(EngineEvent.PEER_DISCONNECTED)
        return True

    def _retire(self, incarnation: str) -> None:
        if not incarnation:
            return
        self.retired_incarnations.pop(incarnation, None)
        self.retired_incarnations[incarnation] = None
        while len(self.retired_incarnations) > RETIRED_INCARNATIONS_KEPT:
            del self.retired_incarnations[next(iter(self.retired_incarnations))]

    def metadata_received(self, metadata: EngineMetadata) -> MetadataOutcome:
        """The reply of the current attempt arrived and checked out; say what it means.

        * A handshake (``FETCHING``): load it. If the pull that started it
          wanted another incarnation than the one that answered, that
          incarnation no longer runs: it is retired, so its requests fail
          ``GONE`` instead of handshaking again.
        * A verification (``VERIFYING``) that finds the loaded incarnation:
          the incarnation the request named is refuted (its requests fail
          ``GONE``), and pulls go on with the loaded agent.
        * A verification that finds a new incarnation: the engine restarted.
          The loaded incarnation is retired and the new one is loaded.
        """
        if self.state is EngineState.VERIFYING:
            if metadata.incarnation == self.incarnation:
                self.apply(EngineEvent.VERIFIED_SAME)
                self._retire(self.sought_incarnation)
                return MetadataOutcome.SAME
            self.apply(EngineEvent.PEER_RESTARTED)
            self._retire(self.epoch)
            outcome = MetadataOutcome.RESTARTED
        else:
            self.apply(EngineEvent.METADATA_RECEIVED)
            outcome = MetadataOutcome.LOAD
        self.incarnation = metadata.incarnation
        if self.rank or metadata.tp_rank:  # (see ``rank``)
            self.epoch = ""
            return outcome
        self.epoch = metadata.incarnation
        self.retired_incarnations.pop(metadata.incarnation, None)
        sought = self.sought_incarnation
        if sought and sought != metadata.incarnation:
            self._retire(sought)
        return outcome

    def verification_failed(self, error: HandshakeError) -> None:
        """The verification got no usable answer: keep the loaded agent in
        service; pulls that need a verification fail fast with ``error``
        until ``verify_again_at``."""
        self.apply(EngineEvent.VERIFY_FAILED)
        self.verify_error = error

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
        self.incarnation = None
        self.failures += 1
        delay = backoff.delay(self.failures, rng)
        self.retry_at = now + delay
        return delay
