"""The tests' HTTP client for real servers (engines, proxies, ``trio-pd serve``)."""

from __future__ import annotations

from typing import Any

import httpx2

from trio_pd._serve.defaults import CLIENT_KEEP_ALIVE


def http_client(timeout: float, **kwargs: Any) -> httpx2.AsyncClient:
    """An ``httpx2.AsyncClient`` that keeps an idle connection for
    ``CLIENT_KEEP_ALIVE`` (2 s), less than the servers' ``SERVER_KEEP_ALIVE``
    (5 s), as the proxy's own clients do.

    With httpx's default (5 s, the servers' too), a request sent after an
    idle spell of about 5 s -- a test waiting out a 5 s lease, say -- could go
    out on a connection the server was closing, and fail with "Server
    disconnected without sending a response" (a clean-clone CI run did,
    session 17). ``kwargs`` go to the client (``headers``, ...).
    """
    limits = httpx2.Limits(keepalive_expiry=CLIENT_KEEP_ALIVE)
    return httpx2.AsyncClient(timeout=timeout, limits=limits, **kwargs)
