"""Which local blocks a transfer may still write (the consumer's promise to its caller).

A pull normally ends with nothing left running: when it returns or raises,
its local blocks are the caller's again. The exception is a transfer NIXL
cannot stop (its peer became unreachable mid-transfer): it may write the
blocks long after the pull ended -- however it ended: an error, a timeout,
the caller's cancellation, a sibling part's failure, the connector closing.
The backend reports each such transfer through the ``unsettled`` callback of
:meth:`~trio_pd.TransferBackend.read`; :class:`UnsettledBlocks` keeps count
per local block until the backend says the transfer ended.

Trio thread only. Nothing here does I/O; waiting is a :class:`trio.Event`
replaced at each change.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

import trio


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
