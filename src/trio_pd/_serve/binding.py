"""Listening sockets, advertised addresses and ready files of the servers (no trio).

An engine or proxy binds its HTTP socket itself, before anything else starts,
and hands it to hypercorn (``fd://``): a bind address that is not this
machine's, or a port in use, fails at once with one clear error, and with
``--port 0`` the real port is known before the engine's id is derived from it.

The listener also carries the server's *send timeout* (``TCP_USER_TIMEOUT``,
which every accepted connection inherits): hypercorn writes each response
chunk in a shielded scope with no deadline, so a client that stops reading
would otherwise block its request's ``send`` -- and hold whatever the request
holds, KV blocks included -- for as long as it keeps the connection open.
With it, the kernel resets a connection whose data has waited that long
against a closed window (or unacknowledged); hypercorn then reports
``http.disconnect``, which cancels the request (:func:`~.asgi.cancel_on_disconnect`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
from typing import Any

from trio_pd._connector import WILDCARD_HOSTS
from trio_pd._core._public_values import unbracket
from trio_pd._serve import defaults

SEND_TIMEOUT = defaults.SEND_TIMEOUT
"""The default ``--send-timeout``, in seconds."""

MAX_SEND_TIMEOUT = (2**31 - 1) // 1000
"""The longest send timeout, in seconds (the kernel takes milliseconds in an int)."""


class BindError(Exception):
    """A server could not bind its address (one line: the address and the reason)."""


def is_wildcard(host: str) -> bool:
    """Whether ``host`` means "every interface" (an address nobody can dial)."""
    return unbracket(host) in WILDCARD_HOSTS


def check_send_timeout(seconds: float) -> None:
    """Raises ValueError (naming ``--send-timeout``) unless ``seconds`` is one."""
    if not 0 < seconds <= MAX_SEND_TIMEOUT:  # (NaN too)
        raise ValueError(f"--send-timeout must be > 0 and at most {MAX_SEND_TIMEOUT} s")


def bind_listener(host: str, port: int, *, send_timeout: float) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not listening yet: hypercorn does that).

    ``""`` and ``"*"`` mean every IPv4 interface; IPv6 addresses may carry brackets.
    The connections it accepts inherit ``send_timeout`` (seconds) as their
    ``TCP_USER_TIMEOUT``: the kernel resets one whose sent data waited that
    long to be acknowledged, or to fit in the client's closed receive window
    (a client that stopped reading).

    Raises:
        BindError: the address does not resolve, is not this machine's, or is in use.
        ValueError: ``send_timeout`` is not one (:func:`check_send_timeout`).
    """
    check_send_timeout(send_timeout)
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
        milliseconds = max(1, math.ceil(send_timeout * 1000))  # (0 would switch it off)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, milliseconds)
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
