"""Exception-group handling for the library's own nurseries."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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
