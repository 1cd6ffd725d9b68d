"""``trio-pd serve``'s engine processes: each one's state as the command sees
it, the board that the command waits on, and the task that runs one process
(SIGTERM on cancellation, SIGKILL after ``--grace`` + 5 s)."""

from __future__ import annotations

import functools
import json
import signal
import subprocess
from collections.abc import Awaitable, Callable

import attrs
import trio
from rich.console import Console

from trio_pd._harness._netns import TestHost


@attrs.define(eq=False)
class EngineProcess:
    """One engine process, as this command sees it."""

    role: str
    index: int
    ready_file: str
    host: TestHost | None = None  # (with --hosts: the test host it runs on)
    url: str = ""  # (from its ready file: it accepts requests)
    status: int | None = None  # its exit status, once it exited
    stopping: bool = False  # this command sent it SIGTERM
    killed: bool = False  # it outlived --grace + 5 s

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"

    def failure(self) -> str:
        """How it failed ("" if it did not)."""
        if self.status is None:
            return ""
        status = describe_status(self.status)
        if self.killed:
            return f"engine {self.name} did not drain within --grace + 5 s (killed)"
        if self.stopping:
            stopped = self.status in (0, -signal.SIGTERM)  # (SIGTERM before its handler)
            return "" if stopped else f"engine {self.name} exited with {status} in its drain"
        if not self.url:
            return f"engine {self.name} exited with {status} before it accepted requests"
        return "" if self.status == 0 else f"engine {self.name} exited with {status} while serving"


class EngineBoard:
    """The engines' states, and a way to wait for a condition on them."""

    def __init__(self, engines: list[EngineProcess]) -> None:
        self.engines = engines
        self._changed = trio.Event()

    def notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, condition: Callable[[], bool]) -> None:
        while not condition():
            await self._changed.wait()

    def urls(self, role: str) -> tuple[str, ...]:
        return tuple(e.url for e in self.engines if e.role == role)

    def serving(self, role: str) -> bool:
        return any(e.role == role and e.status is None for e in self.engines)


async def run_engine_process(
    engine: EngineProcess,
    command: list[str],
    env: dict[str, str],
    grace: float,
    board: EngineBoard,
    console: Console,
) -> None:
    """Run one engine process until it exits, or until cancelled: then SIGTERM it
    (SIGKILL after ``grace`` + 5 s). Records its URL and exit status on ``board``."""

    async def terminate(process: trio.Process) -> None:
        process.send_signal(signal.SIGTERM)
        with trio.move_on_after(grace + 5):
            await process.wait()
            return
        console.print(f"[red]engine {engine.name} did not stop in time: killed[/]")
        engine.killed = True
        process.kill()

    process: trio.Process | None = None
    try:
        async with trio.open_nursery() as nursery:
            process = await nursery.start(
                functools.partial(
                    trio.run_process,
                    command,
                    check=False,
                    deliver_cancel=terminate,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,  # (Ctrl-C in a terminal is this command's alone)
                )
            )
            path = trio.Path(engine.ready_file)
            while process.returncode is None and not engine.url:  # (the engine writes it)
                if await path.exists():
                    engine.url = json.loads(await path.read_text())["url"]
                    board.notify()
                await trio.sleep(0.05)
    finally:
        if process is not None:
            engine.status = process.returncode
            failure = engine.failure()
            if failure:
                console.print(f"[red]{failure}[/]")
            elif engine.stopping:
                status = describe_status(engine.status) if engine.status is not None else "?"
                console.print(f"engine {engine.name} stopped ({status})")
            else:
                console.print(f"[yellow]engine {engine.name} exited with status 0 while serving[/]")
            board.notify()


async def notify_when(event: Callable[[], Awaitable[object]], notify: Callable[[], None]) -> None:
    await event()
    notify()


def describe_status(status: int) -> str:
    """An exit status in words: ``status 1``, ``SIGKILL``."""
    if status < 0:
        try:
            return signal.Signals(-status).name
        except ValueError:
            return f"signal {-status}"
    return f"status {status}"
