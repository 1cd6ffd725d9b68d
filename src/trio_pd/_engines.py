"""The life cycle of a remote engine, as seen by a consumer (no I/O).

Every rule is in :data:`TRANSITIONS`; the docs draw the state diagram from
that table, so picture and code cannot drift. The trio shell in
``_connector.py`` pairs each record with a :class:`trio.Event` per handshake
attempt; this module knows nothing of trio.
"""

from __future__ import annotations

import enum
from typing import Final

import attrs

from ._errors import HandshakeError
from ._layout import KVLayout
from ._protocol import EngineMetadata


class EngineState(enum.Enum):
    """Where a remote engine's handshake stands."""

    UNKNOWN = "unknown"
    """Never seen (or forgotten); the first pull starts a handshake."""
    FETCHING = "fetching"
    """Waiting for a fetch slot or for the metadata reply."""
    LOADING = "loading"
    """Metadata received; queued for, or in, the handshake task (NIXL calls)."""
    READY = "ready"
    """Remote agent loaded and descriptor list prepared: pulls go straight through."""
    FAILED = "failed"
    """The last handshake failed; the next pull starts a new one."""
    CLOSED = "closed"
    """The connector closed; the engine's NIXL state is released."""


class EngineEvent(enum.Enum):
    """What can happen to a remote engine."""

    PULL_REQUESTED = "pull requested"
    METADATA_RECEIVED = "metadata received"
    LOADED = "loaded"
    FAILED = "failed"
    CONNECTOR_CLOSED = "connector closed"


S, E = EngineState, EngineEvent

TRANSITIONS: Final[dict[tuple[EngineState, EngineEvent], EngineState]] = {
    (S.UNKNOWN, E.PULL_REQUESTED): S.FETCHING,
    (S.FAILED, E.PULL_REQUESTED): S.FETCHING,
    (S.FETCHING, E.METADATA_RECEIVED): S.LOADING,
    (S.FETCHING, E.FAILED): S.FAILED,
    (S.LOADING, E.LOADED): S.READY,
    (S.LOADING, E.FAILED): S.FAILED,
    **{(state, E.CONNECTOR_CLOSED): S.CLOSED for state in EngineState if state is not S.CLOSED},
}
"""Every allowed (state, event) -> next state. Anything else is a bug."""

HANDSHAKE_STARTING: Final = frozenset(
    state for (state, event) in TRANSITIONS if event is E.PULL_REQUESTED
)
"""States in which a pull starts a new handshake."""


class InvalidTransition(RuntimeError):
    """A transition not in :data:`TRANSITIONS` was attempted: a trio_pd bug."""


@attrs.define
class EngineRecord:
    """What a consumer knows about one remote engine.

    Attributes:
        engine_id: the remote engine's id.
        host, port: its side-channel address.
        state: see :class:`EngineState`.
        error: the last handshake's error while ``FAILED``.
        metadata: the engine's metadata once received.
        attempts: handshakes started for this engine.
    """

    engine_id: str
    host: str
    port: int
    state: EngineState = EngineState.UNKNOWN
    error: HandshakeError | None = None
    metadata: EngineMetadata | None = None
    layout: KVLayout | None = None
    attempts: int = 0

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
            self.error = None
        self.state = new
        return new

    def metadata_received(self, metadata: EngineMetadata, layout: KVLayout) -> None:
        self.apply(EngineEvent.METADATA_RECEIVED)
        self.metadata = metadata
        self.layout = layout

    def failed(self, error: HandshakeError) -> None:
        self.apply(EngineEvent.FAILED)
        self.error = error
        self.metadata = None
        self.layout = None
