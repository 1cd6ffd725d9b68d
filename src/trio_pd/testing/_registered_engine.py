"""A registered engine in its own process, for the membership tests (killed to make a crash).

The etcd server itself lives in :mod:`trio_pd._harness._etcd_server` (``trio-pd serve
--hosts`` runs one too); this package re-exports it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from typing import Any

import attrs
import trio

from trio_pd._harness._child_process import ChildProcess, open_child, read_lines
from trio_pd._harness._etcd_server import START_TIMEOUT
from trio_pd._membership._members import Member

# ---- a registered engine in its own process (killed to make a crash) --------


async def _registered_main(spec: dict[str, Any]) -> None:
    from trio_pd._membership import Member, register

    stdin = trio.lowlevel.FdStream(os.dup(0))
    stdout = trio.lowlevel.FdStream(os.dup(1))
    member = Member(**spec["member"])
    async with (
        stdin,
        stdout,
        register(spec["etcd_url"], member, prefix=spec["prefix"], ttl=spec["ttl"]) as registration,
    ):
        await stdout.send_all(json.dumps({"key": registration.key}).encode() + b"\n")
        async for _ in stdin:  # until the parent closes our stdin
            pass


@asynccontextmanager
async def open_registered_process(
    etcd_url: str, member: Member, *, prefix: str, ttl: float
) -> AsyncIterator[ChildProcess]:
    """A process that registers ``member`` and keeps it registered until its stdin
    closes; yields it once registered (``process.kill()`` makes a crash)."""
    spec = {"etcd_url": etcd_url, "member": attrs.asdict(member), "prefix": prefix, "ttl": ttl}
    async with open_child("trio_pd.testing._registered_engine", json.dumps(spec)) as process:
        assert process.stdout is not None
        with trio.fail_after(START_TIMEOUT):
            async with aclosing(read_lines(process.stdout)) as lines:
                line = await anext(lines, None)
        if line is None:
            raise RuntimeError("the registering process exited before it registered")
        yield process


def main() -> None:
    """The registering process (see :func:`open_registered_process`)."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    trio.run(_registered_main, json.loads(sys.argv[1]))
