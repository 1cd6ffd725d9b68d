"""Exception-group handling for the library's own nurseries."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TypeVar

import trio


@asynccontextmanager
async def unwrapped_errors() -> AsyncIterator[None]:
    """Raise a lone exception from the nursery as itself, not as a group.

    Cancelled siblings (the consequence of the one real error) are dropped; a
    group of only Cancelled exceptions, or of several real errors, propagates
    unchanged.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        _, rest = group.split(trio.Cancelled)
        if rest is not None:
            leaves = _leaves(rest)
            if len(leaves) == 1:
                error = leaves[0]
                raise error from error.__cause__
        raise


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            out.extend(_leaves(exc))
        else:
            out.append(exc)
    return out


_T = TypeVar("_T")


async def first_failure_wins(calls: Sequence[Callable[[], Awaitable[_T]]]) -> list[_T]:
    """Await every call concurrently and return their results in order.

    The first call to fail cancels the others (a cancelled transfer still
    ends before its task does), and its error propagates alone. One call
    runs in the caller's task, with no nursery.
    """
    if len(calls) == 1:
        return [await calls[0]()]
    results: dict[int, _T] = {}
    failures: list[Exception] = []

    async def run(index: int, call: Callable[[], Awaitable[_T]]) -> None:
        try:
            results[index] = await call()
        except Exception as exc:
            failures.append(exc)
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for index, call in enumerate(calls):
            nursery.start_soon(run, index, call)
    if failures:
        raise failures[0]
    return [results[index] for index in range(len(calls))]
