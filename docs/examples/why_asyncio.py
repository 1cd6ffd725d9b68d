"""Why structured concurrency, 1: the asyncio program (docs/why-structured-concurrency.md).

A request handler starts two background tasks with ``asyncio.create_task``
and returns. One of them fails; the other never ends. Nothing in the
handler's code says so, and nothing makes the caller find out.

Run it with ``python docs/examples/why_asyncio.py`` (about 0.4 s, real time).
"""

import asyncio

# asyncio keeps only a weak reference to a task: the caller must keep one,
# or the task may be garbage-collected mid-run (the asyncio docs say so).
background: set[asyncio.Task[None]] = set()


async def handshake(engine: str) -> None:
    await asyncio.sleep(0.1)
    raise ConnectionError(f"{engine}: no reply")


beats = 0


async def heartbeat() -> None:
    global beats
    while True:
        await asyncio.sleep(0.05)
        beats += 1


async def handle_request() -> str:
    for coroutine, name in [(handshake("prefill-0"), "handshake"), (heartbeat(), "heartbeat")]:
        task = asyncio.create_task(coroutine, name=name)  # a go statement: nobody owns it
        background.add(task)
    await asyncio.sleep(0.2)  # the handshake fails meanwhile
    return "the request answered: ok"


async def main() -> None:
    print(await handle_request())
    await asyncio.sleep(0.2)
    running = sorted(t.get_name() for t in background if not t.done())
    print(f"tasks still running after it returned: {running}")
    [failed] = [t for t in background if t.done()]
    # Only because we kept a reference can we ask; without one, asyncio logs
    # "Task exception was never retrieved" whenever the task is collected.
    print(f"an error nobody was told of: {failed.get_name()}: {failed.exception()!r}")
    # (asyncio.run cancels the heartbeat on the way out, silently)


if __name__ == "__main__":
    asyncio.run(main())
