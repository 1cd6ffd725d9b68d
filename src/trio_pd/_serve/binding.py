"""Listening sockets, advertised addresses and ready files of the servers (no trio).

An engine or proxy binds its HTTP socket itself, before anything else starts,
and hands it to hypercorn (``fd://``): a bind address that is not this
machine's, or a port in use, fails at once with one clear error, and with
``--port 0`` the real port is known before the engine's id is derived from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from typing import Any

from .._open_connector import WILDCARD_HOSTS
from .._records import unbracket


class BindError(Exception):
    """A server could not bind its address (one line: the address and the reason)."""


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means "every interface" (an address nobody can dial)."""
    return unbracket(host) in WILDCARD_HOSTS


def bind_listener(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet: hypercorn does that).

    ``""`` and ``"*"`` mean every IPv4 interface; IPv6 addresses may carry brackets.

    Raises:
        BindError: the address does not resolve, is not this machine's, or is in use.
    """
    host = unbracket(host)
    if host in ("", "*"):
        host = "0.0.0.0"
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise BindError(f"cannot resolve {host!r}: {exc.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot bind {url_host(host)}:{port}: {exc.strerror}") from None
    return sock


def hypercorn_bind(sock: socket.socket) -> str:
    """A hypercorn ``bind`` entry that serves on ``sock``.

    hypercorn owns (and closes) a duplicate of the descriptor; close ``sock``
    once the server started. (If hypercorn fails before it serves -- the
    engine's lifespan failed -- the duplicate stays open until the process
    exits, which the engine process then does.)
    """
    return f"fd://{os.dup(sock.fileno())}"


def url_host(host: str) -> str:
    """``host`` as it goes into a URL (IPv6 addresses in brackets)."""
    host = unbracket(host)
    return f"[{host}]" if ":" in host else host


def base_url(host: str, port: int) -> str:
    """``http://host:port``, for clients (``host`` must not be a wildcard)."""
    return f"http://{url_host(host)}:{port}"


def write_json_atomically(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` so that a reader never sees half of it."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        json.dump(data, f)
    os.replace(temporary, path)


def remove_file(path: str) -> None:
    """Remove ``path`` if it exists (a ready file that must not outlive its server)."""
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
