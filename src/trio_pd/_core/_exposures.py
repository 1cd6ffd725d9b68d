"""Producer-side bookkeeping of exposed blocks and their leases (no I/O).

An *exposure* is a request's blocks held for ``consumers`` decode engines.
Every consumer engine is accounted for once it has read (its transfer
notifications: an engine whose ``k`` ranks read this producer rank sends
``k``, each counting ``1/k``) or *abandoned* (said it will not read, counted
the same way). Once all are, the exposure resolves :attr:`Released.READ` if
none abandoned, else :attr:`Released.ABANDONED`. It resolves
:attr:`Released.EXPIRED` when its deadline passes first.

The deadline is a *lease*: :func:`lease_window` gives the first one and the
cap (``abort_timeout`` after the exposure) that no renewal goes past;
:meth:`ExposureTable.renew` moves it to ``lease_renewal`` after each
consumer heartbeat (which may shorten the first lease: a consumer that
heartbeats and then dies frees the blocks ``lease_renewal`` after its last
heartbeat, not at the end of a long first lease).

A consumer about to READ asks for a *confirmation*
(:meth:`ExposureTable.confirm`): if the exposure is pending, that READ (its
agent, and the nonce its notification will carry) gets a *pin* until
``now + hold_for`` (at most the cap). While an exposure has pins, it
resolves neither by expiry nor by the consumers' reads and abandons: those
are deferred until every pin has ended (its READ's notification arrived,
its agent's abandon named it as a READ that ended, or the pin ran out). So
a READ that ends before its
pin does read blocks that were its request's for the whole READ: the
exposure was pending when the pin was given (so since it was exposed) and
could not end before the pin did -- unless the READ's own agent said it
had ended, which only hurts that agent. A confirmation that arrives after the
READ's own notification was counted answers :attr:`Confirmed.READ`, which
proves the same thing (the notification is sent after the READ's bytes).
Exposures are named by request id *and* a digest of their block ids
(:func:`blocks_digest`): a request id exposed again with other blocks is
another exposure.

Every rule is a function of the ``now`` it is given. Resolved outcomes (and
which agents read) are remembered up to a bound, so that a caller who asks
after the fact still gets the answer.
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import math
from collections import OrderedDict
from collections.abc import Iterable
from fractions import Fraction

import attrs
import numpy as np

from trio_pd._core._layout import BlockIds


class Released(enum.Enum):
    """How an exposure ended: its blocks may now be freed or reused."""

    READ = "read"
    """Every consumer read the blocks and said so."""
    EXPIRED = "expired"
    """The lease ran out (or ``abort_timeout`` passed) first; a late reader
    may see reused blocks."""
    ABANDONED = "abandoned"
    """Every consumer is accounted for and at least one said it will not read."""


class Notice(enum.Enum):
    """What a consumer notification did to the table."""

    COUNTED = "counted"
    """One more consumer of a pending exposure."""
    RELEASED = "released"
    """The last consumer: the exposure resolved (READ, or ABANDONED if any abandoned)."""
    DUPLICATE = "duplicate"
    """That consumer had already been counted (as a reader or as abandoning)."""
    LATE = "late"
    """The exposure had already resolved (usually EXPIRED)."""
    UNKNOWN = "unknown"
    """No exposure with that request id."""


MAX_PINS = 64
"""READs that may hold a pin on one exposure at once (a consumer engine's
ranks, times its consumer engines, times the READs each runs at once); a
confirmation past it is refused, so a peer claiming many agent names or
nonces cannot grow an exposure without bound."""


class Confirmed(enum.Enum):
    """The answer to a consumer's confirmation (:meth:`ExposureTable.confirm`)."""

    HELD = "held"
    """Pending: the READ holds a pin on it (see ``Confirmation.held_for``)."""
    READ = "read"
    """The READ's own notification was counted while the exposure was pending."""
    EXPIRED = "expired"
    """It expired (lease not renewed, or ``abort_timeout``) before the agent read it."""
    ABANDONED = "abandoned"
    """It was abandoned (by this agent or the last of the others)."""
    READ_BY_OTHERS = "read_by_others"
    """Every consumer it was exposed for read it; this agent was not one of them."""
    UNKNOWN = "unknown"
    """Never exposed with these blocks here, or resolved so long ago it was forgotten."""
    TOO_MANY_PINS = "too_many_pins"
    """:data:`MAX_PINS` READs already hold pins on it."""

    @property
    def ok(self) -> bool:
        """Whether the agent may trust what it read (subject to ``held_for``)."""
        return self is Confirmed.HELD or self is Confirmed.READ


@attrs.frozen
class Confirmation:
    """What :meth:`ExposureTable.confirm` answers.

    ``held_for``: with :attr:`Confirmed.HELD`, how long from the ``now`` of
    the call the exposure stays pending unless this READ's notification
    arrives, or this agent's abandon names the READ as ended (0 otherwise).
    """

    state: Confirmed
    held_for: float = 0.0


def blocks_digest(block_ids: Iterable[int] | np.ndarray) -> bytes:
    """8 bytes naming a set of block ids in order (BLAKE2b of their int64s).

    A consumer sends it with a confirmation; the producer compares it with
    the pending exposure's, so that a request id exposed again with other
    blocks is not confirmed for a pull of the old ones.
    """
    array = np.ascontiguousarray(
        block_ids if isinstance(block_ids, np.ndarray) else list(block_ids), dtype=np.int64
    )
    return hashlib.blake2b(array.tobytes(), digest_size=8).digest()


def lease_window(now: float, lease_initial: float, abort_timeout: float) -> tuple[float, float]:
    """``(deadline, limit)`` of an exposure made at ``now``.

    The first deadline is ``lease_initial`` away, never past the limit;
    the limit, ``abort_timeout`` away, is the cap no renewal goes past.
    """
    limit = now + abort_timeout
    return min(now + lease_initial, limit), limit


@attrs.define
class Exposure:
    request_id: str
    block_ids: BlockIds
    consumers: int
    deadline: float
    limit: float
    """No renewal moves ``deadline`` past this (exposed at + ``abort_timeout``)."""
    token: str = attrs.field(default="", repr=False)
    """The token issued for it (empty without an exposure secret)."""
    readers: dict[str, int] = attrs.field(factory=dict)
    """Consumer agents that notified, and how many readers each one's engine has."""
    abandoned: dict[str, int] = attrs.field(factory=dict)
    """Consumer agents that abandoned, and how many readers each one's engine has."""
    outcome: Released | None = None
    digest: bytes = attrs.field(default=b"", repr=False)
    """:func:`blocks_digest` of ``block_ids``."""
    generation: int = 1
    """Which exposure of ``request_id`` this is (1 for its first; see
    :meth:`ExposureTable.generation`)."""
    read_nonces: set[tuple[str, int]] = attrs.field(factory=set)
    """The READs, as ``(agent, nonce)``, whose notifications were counted while
    it was pending: each reader's first, and (at most :data:`MAX_PINS` in
    all) its later READs' (a notification may overtake its READ's confirmation)."""
    pins: dict[tuple[str, int], float] = attrs.field(factory=dict)
    """READs confirmed, as ``(agent, nonce)``, and until when (see
    :meth:`ExposureTable.confirm`): an agent may run several READs of one
    exposure at once, each pinned until its own notification."""
    wake: float = math.inf
    """The earliest time the table's heap names this exposure at (a bound on
    the heap's size: nothing later is pushed)."""

    def ends_at(self) -> float:
        """When this exposure must next be looked at: its lease deadline, or
        its first pin's end while it is pinned."""
        return min(self.pins.values()) if self.pins else self.deadline

    @property
    def engines_read(self) -> Fraction:
        """Consumer engines that have read: each notifying rank is ``1/readers`` of one."""
        return _engines(self.readers)

    @property
    def engines_accounted(self) -> Fraction:
        """Consumer engines that have read or abandoned."""
        return _engines(self.readers) + _engines(self.abandoned)


def _engines(agents: dict[str, int]) -> Fraction:
    return sum((Fraction(1, n) for n in agents.values()), Fraction(0))


_Resolved = tuple[Released, bytes, frozenset[tuple[str, int]], int]


@attrs.define
class ExposureTable:
    """Pending exposures, their deadlines, and a bounded history of outcomes.

    Attributes:
        history: how many resolved exposures to remember.
    """

    history: int
    _pending: dict[str, Exposure] = attrs.field(factory=dict, init=False)
    _resolved: OrderedDict[str, _Resolved] = attrs.field(factory=OrderedDict, init=False)
    """Outcome, blocks digest, the READs counted (agent, nonce) and the
    generation of resolved exposures."""
    _deadlines: list[tuple[float, str]] = attrs.field(factory=list, init=False)
    released: int = attrs.field(default=0, init=False)
    expired: int = attrs.field(default=0, init=False)
    abandoned: int = attrs.field(default=0, init=False)
    renewed: int = attrs.field(default=0, init=False)
    pins_ended: int = attrs.field(default=0, init=False)
    """Pins ended by their agents' abandons (see :meth:`abandon`)."""

    @property
    def pending(self) -> int:
        return len(self._pending)

    def pending_exposure(self, request_id: str) -> Exposure | None:
        """The pending exposure of ``request_id``, ``None`` if it is not pending."""
        return self._pending.get(request_id)

    def expose(
        self,
        request_id: str,
        block_ids: BlockIds,
        consumers: int,
        deadline: float,
        *,
        limit: float | None = None,
        token: str = "",
        digest: bytes | None = None,
        generation: int | None = None,
    ) -> Exposure:
        """Record an exposure that expires at ``deadline`` unless renewed.

        ``limit`` (default: ``deadline``) caps renewals (see
        :func:`lease_window`); ``token`` is what was issued for it;
        ``digest`` is :func:`blocks_digest` of ``block_ids`` (computed if not
        given); ``generation`` is :meth:`generation` (computed if not given).

        Raises:
            ValueError: ``request_id`` is already pending, or ``consumers < 1``.
        """
        if request_id in self._pending:
            raise ValueError(f"request {request_id!r} is already exposed and pending")
        if consumers < 1:
            raise ValueError(f"request {request_id!r}: consumers must be >= 1, got {consumers}")
        limit = deadline if limit is None else limit
        if limit < deadline:
            raise ValueError(f"request {request_id!r}: limit {limit} is before deadline {deadline}")
        if generation is None:
            generation = self.generation(request_id)
        self._resolved.pop(request_id, None)
        if digest is None:
            digest = blocks_digest(block_ids)
        exposure = Exposure(
            request_id,
            block_ids,
            consumers,
            deadline,
            limit,
            token,
            digest=digest,
            generation=generation,
        )
        self._pending[request_id] = exposure
        self._schedule(exposure, deadline)
        return exposure

    def generation(self, request_id: str) -> int:
        """The generation the next exposure of ``request_id`` gets: 1, or one
        more than the last one's while it is remembered (the ranks of an
        engine expose the same requests, so they count alike)."""
        resolved = self._resolved.get(request_id)
        return 1 if resolved is None else resolved[3] + 1

    def renew(self, request_id: str, now: float, extension: float) -> bool:
        """A consumer's heartbeat for ``request_id`` arrived at ``now``.

        The deadline becomes ``now + extension``, never later than the
        exposure's limit -- and earlier than it was if the first lease was
        longer: after a heartbeat, a consumer that stops heartbeating (it
        died) frees the blocks ``extension`` after its last one. Pins are
        not shortened. Counted in ``renewed``.

        Returns:
            whether ``request_id`` is pending (only then is it renewed).
        """
        exposure = self._pending.get(request_id)
        if exposure is None:
            return False
        self.renewed += 1
        exposure.deadline = min(now + extension, exposure.limit)
        self._schedule(exposure, exposure.ends_at())
        return True

    def confirm(
        self,
        request_id: str,
        agent: str,
        digest: bytes,
        now: float,
        hold_for: float,
        nonce: int = 0,
        generation: int = 0,
    ) -> Confirmation:
        """``agent`` is about to READ (or has read) ``request_id``'s blocks: may it?

        If the exposure is pending with these blocks (``digest``), the READ
        ``(agent, nonce)`` gets a pin until ``now + hold_for`` (never past
        the exposure's limit; confirming the same READ again renews it):
        until then the exposure does not resolve, unless that READ's own
        notification arrives, or an abandon of ``agent`` names it as ended
        (an abandon that does not name it leaves it: the READ may still
        run). Answered :attr:`Confirmed.READ` if the notification of
        ``agent``'s READ ``nonce`` was counted while it was pending (whether
        or not it has resolved since, as long as it is remembered): not an
        earlier READ of the same agent, which a replay would be; and why
        not otherwise. ``generation`` (0: any) names the exposure of
        ``request_id`` that the READ's parameters came from: a later one of
        the same request on the same blocks is another exposure.
        """
        exposure = self._pending.get(request_id)
        if exposure is None or not _names(exposure.digest, exposure.generation, digest, generation):
            resolved = self._resolved.get(request_id)
            if resolved is None or not _names(resolved[1], resolved[3], digest, generation):
                return Confirmation(Confirmed.UNKNOWN)
            outcome, _, reads, _ = resolved
            if nonce and (agent, nonce) in reads:
                return Confirmation(Confirmed.READ)
            return Confirmation(_ENDED[outcome])
        if nonce and (agent, nonce) in exposure.read_nonces:
            return Confirmation(Confirmed.READ)
        if agent in exposure.abandoned:
            return Confirmation(Confirmed.ABANDONED)
        pin = (agent, nonce)
        if pin not in exposure.pins and len(exposure.pins) >= MAX_PINS:
            return Confirmation(Confirmed.TOO_MANY_PINS)
        until = min(now + hold_for, exposure.limit)
        if until <= now:
            return Confirmation(Confirmed.EXPIRED)  # (at its cap: expire() resolves it)
        exposure.pins[pin] = until
        self._schedule(exposure, exposure.ends_at())
        return Confirmation(Confirmed.HELD, until - now)

    def abandon(
        self, request_id: str, consumer: str, readers: int = 1, pins: Iterable[int] = ()
    ) -> Notice:
        """``consumer`` will not read ``request_id``: account for it without a read.

        ``consumer`` and ``readers`` count exactly as in :meth:`notify`; an
        agent already counted (read or abandoned) is a duplicate. ``pins``:
        nonces of ``consumer``'s READs of it that have ended (the consumer
        knows they read nothing more): their pins end (counted in
        ``pins_ended``), so the exposure resolves at once if nothing else
        holds it -- also when ``consumer`` was counted already. Only
        ``consumer``'s own pins: a nonce that names no pin of its (another
        agent's, one that ended already, a forgery) does nothing. Pins of
        ``consumer``'s READs not named stay, as every pin, until their
        notification or their end.
        """
        return self._account(request_id, consumer, readers, abandon=True, pins=pins)

    def notify(self, request_id: str, consumer: str, readers: int = 1, nonce: int = 0) -> Notice:
        """Count ``consumer``'s notification for ``request_id``.

        ``consumer`` is the notifying agent; ``readers`` how many ranks of its
        engine read this exposure (each counts as ``1/readers`` of an engine);
        ``nonce`` names the READ (its confirmation names it too).
        """
        return self._account(request_id, consumer, readers, abandon=False, nonce=nonce)

    def _account(
        self,
        request_id: str,
        consumer: str,
        readers: int,
        *,
        abandon: bool,
        nonce: int = 0,
        pins: Iterable[int] = (),
    ) -> Notice:
        exposure = self._pending.get(request_id)
        if exposure is None:
            return Notice.LATE if request_id in self._resolved else Notice.UNKNOWN
        # A notification ends its READ's pin; an abandon, the pins of the
        # agent's READs it names (keyed by agent: never another agent's).
        ended = 0
        for pin in [(consumer, n) for n in pins] if abandon else [(consumer, nonce)]:
            if exposure.pins.pop(pin, None) is not None:
                ended += 1
        if abandon:
            self.pins_ended += ended
        if consumer in exposure.readers or consumer in exposure.abandoned:
            # (another READ of the same agent, or its abandon of READs that ended)
            if not abandon and nonce and len(exposure.read_nonces) < MAX_PINS:
                exposure.read_nonces.add((consumer, nonce))
            if ended and self._settle(exposure):
                return Notice.RELEASED
            return Notice.DUPLICATE
        (exposure.abandoned if abandon else exposure.readers)[consumer] = readers
        if not abandon and nonce:
            exposure.read_nonces.add((consumer, nonce))
        return Notice.RELEASED if self._settle(exposure) else Notice.COUNTED

    def _settle(self, exposure: Exposure) -> bool:
        """Resolve ``exposure`` if every consumer is accounted for and no pin
        holds it (READ, or ABANDONED if any abandoned); whether it did.

        (Accounted for while a READ holds a pin: it resolves when the last
        pin ends, see :meth:`expire`.)
        """
        if exposure.engines_accounted < exposure.consumers or exposure.pins:
            self._schedule(exposure, exposure.ends_at())
            return False
        self._resolve(exposure, Released.ABANDONED if exposure.abandoned else Released.READ)
        return True

    def expire(self, now: float) -> list[Exposure]:
        """Resolve what time has ended by ``now``: drop pins that ran out, then
        resolve every exposure with no pin left whose consumers are all
        accounted for (READ, or ABANDONED), or whose deadline has passed
        (EXPIRED). Returns the exposures resolved, in the order they were."""
        out: list[Exposure] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            when, request_id = heapq.heappop(self._deadlines)
            exposure = self._pending.get(request_id)
            if exposure is None:
                continue
            if when == exposure.wake:
                exposure.wake = math.inf
            for pin in [p for p, until in exposure.pins.items() if until <= now]:
                del exposure.pins[pin]
            if exposure.pins:
                pass
            elif exposure.engines_accounted >= exposure.consumers:
                self._resolve(exposure, Released.ABANDONED if exposure.abandoned else Released.READ)
                out.append(exposure)
                continue
            elif exposure.deadline <= now:
                self._resolve(exposure, Released.EXPIRED)
                out.append(exposure)
                continue
            self._schedule(exposure, exposure.ends_at())
        return out

    def next_deadline(self) -> float | None:
        """The earliest time :meth:`expire` has something to do (``None``: nothing pending)."""
        while self._deadlines:
            when, request_id = self._deadlines[0]
            exposure = self._pending.get(request_id)
            if exposure is None:
                heapq.heappop(self._deadlines)
                continue
            due = exposure.ends_at()
            if when >= due:
                return when
            heapq.heappop(self._deadlines)  # (moved later since: look again then)
            if when == exposure.wake:
                exposure.wake = math.inf
            self._schedule(exposure, due)
        return None

    def _schedule(self, exposure: Exposure, when: float) -> None:
        """Have :meth:`expire` look at ``exposure`` at ``when`` (or earlier)."""
        if when < exposure.wake:
            exposure.wake = when
            heapq.heappush(self._deadlines, (when, exposure.request_id))

    def outcome(self, request_id: str) -> Released | None:
        """The outcome, ``None`` while pending.

        Raises:
            KeyError: never exposed, or resolved so long ago it was forgotten.
        """
        if request_id in self._pending:
            return None
        try:
            return self._resolved[request_id][0]
        except KeyError:
            raise KeyError(
                f"request {request_id!r} is not exposed (or its outcome was forgotten)"
            ) from None

    def _resolve(self, exposure: Exposure, outcome: Released) -> None:
        exposure.outcome = outcome
        del self._pending[exposure.request_id]
        exposure.pins.clear()
        self._resolved[exposure.request_id] = (
            outcome,
            exposure.digest,
            frozenset(exposure.read_nonces),
            exposure.generation,
        )
        while len(self._resolved) > self.history:
            self._resolved.popitem(last=False)
        if outcome is Released.READ:
            self.released += 1
        elif outcome is Released.ABANDONED:
            self.abandoned += 1
        else:
            self.expired += 1


def _names(digest: bytes, generation: int, wanted_digest: bytes, wanted_generation: int) -> bool:
    """Whether an exposure of ``digest`` and ``generation`` is the one a
    confirmation names (a generation of 0 names any)."""
    return digest == wanted_digest and wanted_generation in (0, generation)


_ENDED = {
    Released.EXPIRED: Confirmed.EXPIRED,
    Released.ABANDONED: Confirmed.ABANDONED,
    Released.READ: Confirmed.READ_BY_OTHERS,
}
"""What a confirmation of a resolved exposure answers an agent that did not read it."""


PIN_SLACK = 0.01
"""The fraction of a pin a consumer does not count on (clocks of two hosts
may run at slightly different rates; NTP keeps them within 0.05 %)."""


def pin_covers(held_for: float, sent_at: float, read_done_at: float) -> bool:
    """The consumer's side of a :attr:`Confirmed.HELD` answer: whether its READ
    ended inside the pin.

    The producer pinned the exposure at some time after ``sent_at`` (when
    the consumer sent the confirmation, by its clock) for ``held_for``
    seconds, so the pin lasts at least until ``sent_at + held_for`` by the
    consumer's clock (less :data:`PIN_SLACK`). A READ that ended
    (``read_done_at``) before that read the request's own blocks; one that
    ended later must be confirmed again (a ``held`` or ``read`` answer sent
    after the READ ended proves the exposure was pending all along).
    """
    return read_done_at <= sent_at + held_for * (1 - PIN_SLACK)
