"""Finding free ports (used by servers and by tests alike)."""

from __future__ import annotations


def free_port_range(count: int, host: str = "127.0.0.1") -> int:
    """A base port ``p`` such that ``p .. p + count - 1`` were free just now.

    For tensor-parallel engines (rank ``r`` binds ``p + r``) when no base
    port was given. Like
    any "find a free port" helper it can race with other processes; it
    tries up to 50 bases.

    Raises:
        OSError: no such range was found.
    """
    import socket

    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = int(probe.getsockname()[1])
        if base + count > 65536:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind((host, port))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return base
    raise OSError(f"no {count} consecutive free ports found on {host}")
