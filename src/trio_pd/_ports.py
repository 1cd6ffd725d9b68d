"""Finding free ports (used by servers and by tests alike)."""

from __future__ import annotations

import random
import socket

LOWEST = 20000
"""The lowest base :func:`free_port_range` picks (below: well-known services)."""

_pick_base = random.randrange  # (a test replaces it, here only)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port_range(count: int, host: str = "127.0.0.1") -> int:
    """A base port ``p`` such that ``p .. p + count - 1`` were free just now.

    For tensor-parallel engines (rank ``r`` binds ``p + r``) when no base
    port was given. The base is drawn at random between 20000 and
    the kernel's ephemeral range, which the kernel never hands out by
    itself: a port from that range, free when probed, could be taken by
    any process's next outgoing connection before the engine binds it (seen
    with tests running in parallel). Like any "find a free port" helper it
    can still race with another process that picks ports; it tries up to 50
    bases.

    Raises:
        OSError: no such range was found.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    high = _ephemeral_low() - count
    if high <= LOWEST:  # (an unusual ephemeral range: fall back to all of them)
        high = 65536 - count
    for _ in range(50):
        base = _pick_base(LOWEST, high)
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
