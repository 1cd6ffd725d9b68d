"""Common mistake: ``except`` where a nursery raises an ``ExceptionGroup``
(docs/common-mistakes.md).

Two pulls run in a nursery; one fails with a transfer error. The nursery
raises an ``ExceptionGroup``, which a plain ``except TransferError`` does
not match; ``except*`` does, and lets any other error go on.

Run it with ``python docs/mistakes/except_star.py`` (mock clock: at once).
"""

from __future__ import annotations

import trio
import trio.testing


class TransferError(Exception):
    pass


async def pull(request_id: str, error: Exception | None) -> None:
    if error is not None:
        raise error  # (at once, before a checkpoint: so every error lands in the group)
    await trio.sleep(0.1)  # the READ


async def pulls(errors: dict[str, Exception | None]) -> None:
    async with trio.open_nursery() as nursery:
        for request_id, error in errors.items():
            nursery.start_soon(pull, request_id, error)


async def wrong(errors: dict[str, Exception | None]) -> None:
    try:
        await pulls(errors)
    except TransferError as exc:  # never matches: the nursery raises a group
        print(f"   handled: {exc}")


async def right(errors: dict[str, Exception | None]) -> None:
    try:
        await pulls(errors)
    except* TransferError as group:  # the TransferErrors in the group, however many
        for exc in group.exceptions:
            print(f"   handled: {exc}")


async def main() -> None:
    one_fails: dict[str, Exception | None] = {"req-1": TransferError("req-1: peer lost")}
    one_fails["req-2"] = None
    print("-- wrong: except TransferError")
    try:
        await wrong(one_fails)
    except ExceptionGroup as group:
        print(f"   escaped: {group!r}")
    print("-- right: except* TransferError")
    await right(one_fails)
    print("-- right, with a bug beside it")
    try:
        await right({"req-3": TransferError("req-3: peer lost"), "req-4": KeyError("bug")})
    except ExceptionGroup as group:
        print(f"   and the bug went on: {group!r}")


if __name__ == "__main__":
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
