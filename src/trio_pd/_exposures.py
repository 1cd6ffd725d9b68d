"""Producer-side bookkeeping of exposed blocks (no I/O).

An *exposure* is a request's blocks held for ``consumers`` decode engines. It
resolves :attr:`Released.READ` once that many consumer engines have sent
their transfer notifications (an engine whose ``k`` ranks read this producer
rank sends ``k``, each counting ``1/k``), or :attr:`Released.EXPIRED` when its deadline
passes first. Resolved outcomes are remembered (up to a bound) so that a
caller who asks after the fact still gets the answer.
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
    """The abort timeout passed first; a late reader may see reused blocks."""


class Notice(enum.Enum):
    """What a consumer notification did to the table."""

    COUNTED = "counted"
    """One more consumer of a pending exposure."""
    RELEASED = "released"
    """The last consumer: the exposure resolved READ."""
    DUPLICATE = "duplicate"
    """That consumer had already been counted."""
    LATE = "late"
    """The exposure had already resolved (usually EXPIRED)."""
    UNKNOWN = "unknown"
    """No exposure with that request id."""


@attrs.define
class Exposure:
    request_id: str
    block_ids: BlockIds
    consumers: int
    deadline: float
    readers: dict[str, int] = attrs.field(factory=dict)
    """Consumer agents that notified, and how many readers each one's engine has."""
    outcome: Released | None = None

    @property
    def engines_read(self) -> Fraction:
        """Consumer engines that have read: each notifying rank is ``1/readers`` of one."""
        return sum((Fraction(1, n) for n in self.readers.values()), Fraction(0))


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

    @property
    def pending(self) -> int:
        return len(self._pending)

    def expose(
        self, request_id: str, block_ids: BlockIds, consumers: int, deadline: float
    ) -> Exposure:
        """Record an exposure.

        Raises:
            ValueError: ``request_id`` is already pending, or ``consumers < 1``.
        """
        if request_id in self._pending:
            raise ValueError(f"request {request_id!r} is already exposed and pending")
        if consumers < 1:
            raise ValueError(f"request {request_id!r}: consumers must be >= 1, got {consumers}")
        self._resolved.pop(request_id, None)
        exposure = Exposure(request_id, block_ids, consumers, deadline)
        self._pending[request_id] = exposure
        heapq.heappush(self._deadlines, (deadline, request_id))
        return exposure

    def notify(self, request_id: str, consumer: str, readers: int = 1) -> Notice:
        """Count ``consumer``'s notification for ``request_id``.

        ``consumer`` is the notifying agent; ``readers`` how many ranks of its
        engine read this exposure (each counts as ``1/readers`` of an engine).
        """
        exposure = self._pending.get(request_id)
        if exposure is None:
            return Notice.LATE if request_id in self._resolved else Notice.UNKNOWN
        if consumer in exposure.readers:
            return Notice.DUPLICATE
        exposure.readers[consumer] = readers
        if exposure.engines_read < exposure.consumers:
            return Notice.COUNTED
        self._resolve(exposure, Released.READ)
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
        else:
            self.expired += 1
