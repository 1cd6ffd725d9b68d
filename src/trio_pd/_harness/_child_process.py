"""Child processes driven over pipes (prefill workers, latency relays, registered engines).

The parent writes to the child's stdin and reads lines from its stdout; the
child runs until its stdin reaches end of file. :func:`open_child` owns the
process: on every exit it closes the child's stdin, gives it a moment to
finish, kills it if it does not, reaps it and closes the pipes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from contextlib import asynccontextmanager

import trio

EXIT_TIMEOUT = 10.0
"""How long a child may take to exit after its stdin closed, before it is killed."""


@asynccontextmanager
async def open_child(
    module: str, argument: str, *, netns: str = "", env: Mapping[str, str] | None = None
) -> AsyncIterator[trio.Process]:
    """Run ``module.main()`` in a new Python process, ``argument`` in ``sys.argv[1]``,
    with stdin and stdout as pipes.

    ``netns``: run it in that network namespace (``ip netns exec``, which
    execs, so the process is the Python one). ``env``: variables added to
    this process's environment for it.

    (Not ``python -m module``: runpy warns about running a module that its
    package's ``__init__`` already imported, as a package that re-exports it
    does.)

    Resource handling: on exit (normal, error or cancellation; shielded) the
    child's stdin is closed, the child is waited for at most
    :data:`EXIT_TIMEOUT` seconds and killed if still running, then reaped; both
    pipes are closed.
    """
    prefix = ["ip", "netns", "exec", netns] if netns else []
    process = await trio.lowlevel.open_process(
        [*prefix, sys.executable, "-c", f"import {module} as m; m.main()", argument],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    try:
        yield process
    finally:
        with trio.CancelScope(shield=True):
            if process.stdin is not None:
                await process.stdin.aclose()
            with trio.move_on_after(EXIT_TIMEOUT):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            if process.stdout is not None:
                await process.stdout.aclose()


async def read_lines(stream: trio.abc.ReceiveStream) -> AsyncGenerator[bytes, None]:
    """The non-empty lines of ``stream``, without their newlines, until it ends."""
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
