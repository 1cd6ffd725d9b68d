"""An engine's KV-cache block pool: first come, first served, with a deadline."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import attrs
import trio


class OutOfBlocks(Exception):
    """The KV-cache pool did not have enough free blocks in time."""


@attrs.define(eq=False)
class _Turn:
    """A request waiting for blocks; ``blocks`` are set aside for it when granted."""

    count: int
    granted: trio.Event = attrs.field(factory=trio.Event)
    blocks: list[int] = attrs.field(factory=list)


class BlockPool:
    """The free KV-cache blocks of an engine, handed out first come, first served.

    Trio thread only. A request that needs more blocks than are free waits
    (in order: a large request is not starved by small ones) until enough
    are released or its deadline passes. Blocks are set aside for a waiter
    when it is granted, so nobody takes them before it runs.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._waiters: collections.deque[_Turn] = collections.deque()

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def allocate(self, count: int, *, deadline: float) -> list[int]:
        """``count`` blocks, waiting until ``deadline`` (trio's clock) for them.

        Raises:
            ValueError: ``count`` is more than the whole pool.
            OutOfBlocks: not enough were free by ``deadline``.
        """
        if count > self.num_blocks:
            raise ValueError(f"{count} KV blocks needed, the pool has {self.num_blocks}")
        turn = _Turn(count)
        self._waiters.append(turn)
        self._grant()
        try:
            with trio.move_on_at(deadline):
                await turn.granted.wait()
        except BaseException:  # cancelled (the client left): give back or step out
            self._withdraw(turn)
            raise
        if not turn.granted.is_set():
            self._withdraw(turn)
            raise OutOfBlocks(
                f"{count} KV blocks needed, {len(self._free)} free after waiting "
                f"({len(self._waiters)} requests still waiting)"
            )
        return turn.blocks

    def release(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)
        self._grant()

    def _withdraw(self, turn: _Turn) -> None:
        if turn.granted.is_set():
            self.release(turn.blocks)
        else:
            self._waiters.remove(turn)
            self._grant()  # (the next one may fit now)

    def _grant(self) -> None:
        """Set blocks aside for the waiters at the head of the line, in order."""
        while self._waiters and self._waiters[0].count <= len(self._free):
            turn = self._waiters.popleft()
            taken = self._free[len(self._free) - turn.count :]
            del self._free[len(self._free) - turn.count :]
            turn.blocks = taken[::-1]
            turn.granted.set()
