"""Common mistake: forgetting ``await`` (docs/common-mistakes.md).

Calling an async function without ``await`` makes a coroutine object and
runs nothing; passing such an object to ``start_soon`` is refused.

Run it with ``python docs/mistakes/forgot_await.py``.
"""

from __future__ import annotations

import warnings

import trio
import trio.testing

released: list[str] = []


async def release(request_id: str) -> None:
    """Tell the producer it may free the request's blocks."""
    await trio.sleep(0.1)  # the message's round trip
    released.append(request_id)


async def wrong() -> None:
    release("req-1")  # a coroutine object, made and dropped: nothing runs


async def wrong_too(nursery: trio.Nursery) -> None:
    nursery.start_soon(release("req-2"))  # type: ignore[arg-type]  # called, not passed


async def right(nursery: trio.Nursery) -> None:
    await release("req-3")  # runs it, here, to its end
    nursery.start_soon(release, "req-4")  # the function and its arguments: a task runs it


async def main() -> None:
    print("-- wrong: release(...) without await")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await wrong()
    print(f"   released: {released}")
    for warning in caught:
        print(f"   Python warned: {warning.category.__name__}: {warning.message}")
    print("-- wrong too: nursery.start_soon(release(...))")
    async with trio.open_nursery() as nursery:
        try:
            await wrong_too(nursery)
        except TypeError as exc:
            print(f"   TypeError: {str(exc).split(' <')[0]}")
    print("-- right: await release(...); nursery.start_soon(release, ...)")
    async with trio.open_nursery() as nursery:
        await right(nursery)
    print(f"   released: {released}")


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
