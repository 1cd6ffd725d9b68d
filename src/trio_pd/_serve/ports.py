"""Finding free ports (used by servers and by tests alike)."""

from __future__ import annotations

import fcntl
import os
import random
import socket
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

LOWEST = 20000
"""The lowest base :func:`free_port_range` picks (below: well-known services)."""

HOLD = 600.0
"""Seconds for which a range that :func:`free_port_range` handed out is kept
from its other callers on this machine (any process of the same user)."""

RESERVATIONS = Path(tempfile.gettempdir()) / f"trio-pd-ports-{os.getuid()}"
"""The file (one per user) of the ranges handed out in the last ``HOLD``
seconds: ``base count until`` a line, read and rewritten under ``flock``."""

_pick_base = random.SystemRandom().randrange
"""Draws a base port. Not the module-level ``random``: test frameworks seed that
(hypothesis does, per example), and a replayed seed then drew the same bases
as the run before it, every one still reserved (a test replaces it, here only)."""


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def parse_reservations(text: str, now: float) -> list[tuple[int, int, float]]:
    """The ``(base, count, until)`` lines of ``text`` still held at ``now``
    (malformed lines are dropped: the file is only a hint)."""
    held = []
    for line in text.splitlines():
        try:
            base, count, until = line.split()
            entry = (int(base), int(count), float(until))
        except ValueError:
            continue
        if entry[2] > now:
            held.append(entry)
    return held


def overlaps(base: int, count: int, held: Iterable[tuple[int, int, float]]) -> bool:
    """Whether ``base .. base + count - 1`` shares a port with a held range."""
    return any(base < b + c and b < base + count for b, c, _ in held)


def format_reservations(held: Iterable[tuple[int, int, float]]) -> str:
    return "".join(f"{base} {count} {until:.3f}\n" for base, count, until in held)


def free_port_range(count: int, host: str = "127.0.0.1") -> int:
    """A base port ``p`` such that ``p .. p + count - 1`` were free just now.

    For tensor-parallel engines (rank ``r`` binds ``p + r``) when no base
    port was given. The base is drawn at random between 20000 and
    the kernel's ephemeral range, which the kernel never hands out by
    itself: a port from that range, free when probed, could be taken by
    any process's next outgoing connection before the engine binds it (seen
    with tests running in parallel). A range handed out is written to a
    file in the temp dir (``trio-pd-ports-UID``) and not handed out again,
    to any process of this user, for 10 minutes, so that two callers at
    once (two test workers, say) never draw the same ports before they bind
    them (without a writable temp dir, no reservation is kept). Like any
    "find a free port" helper it can still race with other programs that
    pick ports; it tries up to 50 bases.

    Raises:
        OSError: no such range was found.
    """
    try:
        registry = RESERVATIONS.open("a+")
    except OSError:
        return _probe(count, host, [])
    with registry:
        fcntl.flock(registry, fcntl.LOCK_EX)  # (a moment: other callers' probes)
        registry.seek(0)
        now = time.time()
        held = parse_reservations(registry.read(), now)
        base = _probe(count, host, held)
        held.append((base, count, now + HOLD))
        registry.seek(0)
        registry.truncate()
        registry.write(format_reservations(held))
        return base


def _probe(count: int, host: str, held: list[tuple[int, int, float]]) -> int:
    """A random base, clear of ``held``, whose ``count`` ports bind on ``host``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    high = _ephemeral_low() - count
    if high <= LOWEST:  # (an unusual ephemeral range: fall back to all of them)
        high = 65536 - count
    for _ in range(50):
        base = _pick_base(LOWEST, high)
        if overlaps(base, count, held):
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(family)
                sockets.append(sock)
                sock.bind((host, port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base
    raise OSError(f"no {count} consecutive free ports found on {host}")
