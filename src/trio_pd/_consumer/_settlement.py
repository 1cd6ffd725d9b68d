"""Which local blocks a transfer may still write (the consumer's promise to its
caller), and which confirmed READs ended without reading (the producer's pins
an abandon may end).

A pull normally ends with nothing left running: when it returns or raises,
its local blocks are the caller's again. The exception is a transfer NIXL
cannot stop (its peer became unreachable mid-transfer): it may write the
blocks long after the pull ended -- however it ended: an error, a timeout,
the caller's cancellation, a sibling part's failure, the connector closing.
The backend reports each such transfer through the ``unsettled`` callback of
:meth:`~trio_pd.TransferBackend.read`; :class:`UnsettledBlocks` keeps count
per local block until the backend says the transfer ended.

The other side of the same fact: a pull whose READ was confirmed holds a
*pin* on the producer's blocks (see ``_core._exposures``) until the READ's
notification arrives or the pin runs out. A READ that ended without its
notification (the pull was cancelled or failed, and the READ stopped) reads
nothing any more: :class:`SettledReads` keeps its nonce, per exposure and
producer rank, so that the abandon of that exposure names it and the
producer ends its pin at once. A READ that could not be stopped is not kept
(its pin lasts until it ends, or runs out).

Trio thread only. Nothing here does I/O; waiting is a :class:`trio.Event`
replaced at each change.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable

import trio

from trio_pd._core._exposures import MAX_PINS
from trio_pd._core._public_values import RemoteBlocks

Rank = tuple[str, str, int]
"""One producer rank: ``(engine_id, host, port)``."""

MAX_EXPOSURES = 4096
"""Exposures whose settled READs are kept at once (the oldest forgotten past
it: a pull that failed outside a hold, and was never abandoned, leaves its
nonces here)."""


class UnsettledBlocks:
    """Local block ids that a still-running transfer may write, with their waiters."""

    def __init__(self) -> None:
        self._counts: Counter[int] = Counter()
        self._changed = trio.Event()

    def hold(self, block_ids: Iterable[int]) -> Callable[[], None]:
        """Mark ``block_ids`` unsettled; return the (idempotent) call that settles them."""
        ids = tuple(int(b) for b in block_ids)
        self._counts.update(ids)
        released = False

        def settle() -> None:
            nonlocal released
            if released:
                return
            released = True
            self._counts.subtract(ids)
            for block in ids:
                if self._counts[block] <= 0:
                    del self._counts[block]
            self._changed.set()
            self._changed = trio.Event()

        return settle

    def snapshot(self) -> frozenset[int]:
        """The block ids unsettled now."""
        return frozenset(self._counts)

    def __len__(self) -> int:
        return len(self._counts)

    async def wait_settled(self, block_ids: Iterable[int]) -> None:
        """Return once none of ``block_ids`` is unsettled (at once if none is).

        Always checkpoints. Cancellable; bound it with a cancel scope.
        """
        wanted = {int(b) for b in block_ids}
        await trio.lowlevel.checkpoint()
        while not wanted.isdisjoint(self._counts):
            await self._changed.wait()


class SettledReads:
    """Nonces of this agent's confirmed READs that ended without reading, per
    exposure and producer rank, until an abandon of that exposure takes them.

    Bounded: :data:`~trio_pd._core._exposures.MAX_PINS` (as many as a producer
    pins on one exposure) per exposure and rank, the latest kept, and
    :data:`MAX_EXPOSURES` exposures, the least recently added forgotten.
    """

    def __init__(self, exposures: int = MAX_EXPOSURES) -> None:
        self._exposures = exposures
        self._reads: OrderedDict[RemoteBlocks, dict[Rank, list[int]]] = OrderedDict()

    def add(self, exposure: RemoteBlocks, rank: Rank, nonce: int) -> None:
        """READ ``nonce`` of ``exposure`` at producer ``rank`` ended, and reads nothing any more."""
        ranks = self._reads.get(exposure)
        if ranks is None:
            ranks = self._reads[exposure] = {}
            while len(self._reads) > self._exposures:
                self._reads.popitem(last=False)
        else:
            self._reads.move_to_end(exposure)
        nonces = ranks.setdefault(rank, [])
        nonces.append(nonce)
        del nonces[:-MAX_PINS]

    def take(self, exposure: RemoteBlocks) -> dict[Rank, list[int]]:
        """The settled READs of ``exposure``, by rank, now forgotten (an abandon names them)."""
        return self._reads.pop(exposure, {})

    def __len__(self) -> int:
        return len(self._reads)
