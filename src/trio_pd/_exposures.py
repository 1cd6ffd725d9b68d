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
:meth:`ExposureTable.renew` extends it when a consumer's heartbeat arrives.
Every rule is a function of the ``now`` it is given. Resolved outcomes are
remembered (up to a bound) so that a caller who asks after the fact still gets
the answer.
"""

from __future__ import annotations

import enum
import heapq
from collections import OrderedDict
from fractions import Fraction

import attrs

from ._layout import BlockIds


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


@attrs.define
class ExposureTable:
    """Pending exposures, their deadlines, and a bounded history of outcomes.

    Attributes:
        history: how many resolved exposures to remember.
    """

    history: int
    _pending: dict[str, Exposure] = attrs.field(factory=dict, init=False)
    _resolved: OrderedDict[str, Released] = attrs.field(factory=OrderedDict, init=False)
    _deadlines: list[tuple[float, str]] = attrs.field(factory=list, init=False)
    released: int = attrs.field(default=0, init=False)
    expired: int = attrs.field(default=0, init=False)
    abandoned: int = attrs.field(default=0, init=False)
    renewed: int = attrs.field(default=0, init=False)

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
    ) -> Exposure:
        """Record an exposure that expires at ``deadline`` unless renewed.

        ``limit`` (default: ``deadline``) caps renewals (see
        :func:`lease_window`); ``token`` is what was issued for it.

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
        self._resolved.pop(request_id, None)
        exposure = Exposure(request_id, block_ids, consumers, deadline, limit, token)
        self._pending[request_id] = exposure
        heapq.heappush(self._deadlines, (deadline, request_id))
        return exposure

    def renew(self, request_id: str, now: float, extension: float) -> bool:
        """A consumer's heartbeat for ``request_id`` arrived at ``now``.

        The deadline becomes ``now + extension`` if that is later, but never
        later than the exposure's limit. Counted in ``renewed``.

        Returns:
            whether ``request_id`` is pending (only then is it renewed).
        """
        exposure = self._pending.get(request_id)
        if exposure is None:
            return False
        self.renewed += 1
        deadline = max(exposure.deadline, min(now + extension, exposure.limit))
        if deadline != exposure.deadline:
            exposure.deadline = deadline
            heapq.heappush(self._deadlines, (deadline, request_id))
        return True

    def abandon(self, request_id: str, consumer: str, readers: int = 1) -> Notice:
        """``consumer`` will not read ``request_id``: account for it without a read.

        ``consumer`` and ``readers`` count exactly as in :meth:`notify`; an
        agent already counted (read or abandoned) is a duplicate.
        """
        return self._account(request_id, consumer, readers, abandon=True)

    def notify(self, request_id: str, consumer: str, readers: int = 1) -> Notice:
        """Count ``consumer``'s notification for ``request_id``.

        ``consumer`` is the notifying agent; ``readers`` how many ranks of its
        engine read this exposure (each counts as ``1/readers`` of an engine).
        """
        return self._account(request_id, consumer, readers, abandon=False)

    def _account(self, request_id: str, consumer: str, readers: int, *, abandon: bool) -> Notice:
        exposure = self._pending.get(request_id)
        if exposure is None:
            return Notice.LATE if request_id in self._resolved else Notice.UNKNOWN
        if consumer in exposure.readers or consumer in exposure.abandoned:
            return Notice.DUPLICATE
        (exposure.abandoned if abandon else exposure.readers)[consumer] = readers
        if exposure.engines_accounted < exposure.consumers:
            return Notice.COUNTED
        self._resolve(exposure, Released.ABANDONED if exposure.abandoned else Released.READ)
        return Notice.RELEASED

    def expire(self, now: float) -> list[Exposure]:
        """Resolve EXPIRED every pending exposure whose deadline is ``<= now``."""
        out: list[Exposure] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            deadline, request_id = heapq.heappop(self._deadlines)
            exposure = self._pending.get(request_id)
            if exposure is not None and exposure.deadline == deadline:
                self._resolve(exposure, Released.EXPIRED)
                out.append(exposure)
        return out

    def next_deadline(self) -> float | None:
        while self._deadlines:
            deadline, request_id = self._deadlines[0]
            exposure = self._pending.get(request_id)
            if exposure is not None and exposure.deadline == deadline:
                return deadline
            heapq.heappop(self._deadlines)
        return None

    def outcome(self, request_id: str) -> Released | None:
        """The outcome, ``None`` while pending.

        Raises:
            KeyError: never exposed, or resolved so long ago it was forgotten.
        """
        if request_id in self._pending:
            return None
        try:
            return self._resolved[request_id]
        except KeyError:
            raise KeyError(
                f"request {request_id!r} is not exposed (or its outcome was forgotten)"
            ) from None

    def _resolve(self, exposure: Exposure, outcome: Released) -> None:
        exposure.outcome = outcome
        del self._pending[exposure.request_id]
        self._resolved[exposure.request_id] = outcome
        while len(self._resolved) > self.history:
            self._resolved.popitem(last=False)
        if outcome is Released.READ:
            self.released += 1
        elif outcome is Released.ABANDONED:
            self.abandoned += 1
        else:
            self.expired += 1
