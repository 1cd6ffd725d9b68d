"""Which engine gets a request: fewest in flight, skipping unreachable ones (no I/O).

The proxy asks :meth:`EngineSet.candidates` for an order to try engines in,
and wraps each attempt in :meth:`EngineSet.attempt` (which counts it in
flight). The order: engines not marked down first, then fewest requests in
flight, then a rotating start, so equal engines share the load and a busy
one is passed over. An engine is marked down (for :data:`DOWN_FOR` s) only
when it *refused* a connection -- it is gone, and the request never reached
it; a slow answer from a busy engine is not a reason to avoid it, nor to
send the same work elsewhere.

The set can change while the proxy runs (membership on etcd): engines that
leave are no longer offered; requests in flight to them finish on their own.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import httpx2

DOWN_FOR = 5.0
"""Seconds an engine that refused a connection is tried only after all others."""


def url_problem(url: str) -> str | None:
    """Why ``url`` is not an engine's base URL (``None``: it is one): an
    ``http://`` or ``https://`` URL with a host, a port in range if any,
    and no spaces, query or fragment -- what the proxy's HTTP client can
    build a request to."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return "an engine's URL starts with http:// or https://"
    if any(c.isspace() for c in url) or "?" in url or "#" in url:
        return "an engine's URL has no spaces, query or fragment"
    try:
        parsed = httpx2.URL(url)
        port = parsed.port
    except (httpx2.InvalidURL, ValueError, TypeError) as exc:
        return f"not a URL ({exc})"
    if not parsed.host:
        return "an engine's URL names a host"
    if port is not None and not 1 <= port <= 65535:
        return f"port {port} is not a port"
    return None


class EngineSet:
    """One role's engines (base URLs), their requests in flight and their refusals.

    Trio thread only; times are an argument (any clock).
    """

    def __init__(self, engines: Iterable[str] = ()) -> None:
        self._engines: list[str] = []
        self._in_flight: dict[str, int] = {}
        self._down_until: dict[str, float] = {}
        self._turn = itertools.count()
        self.update(engines)

    @property
    def engines(self) -> list[str]:
        return list(self._engines)

    def update(self, engines: Iterable[str]) -> None:
        """Serve these engines from now on (in-flight counts of those that stay are kept)."""
        self._engines = list(dict.fromkeys(engines))
        for engine in self._engines:
            self._in_flight.setdefault(engine, 0)

    def in_flight(self, engine: str) -> int:
        return self._in_flight.get(engine, 0)

    def candidates(self, now: float) -> list[str]:
        """Every engine once, in the order to try them (see the module docstring)."""
        if not self._engines:
            return []
        start = next(self._turn) % len(self._engines)
        rotated = self._engines[start:] + self._engines[:start]
        return sorted(
            rotated,
            key=lambda e: (self._down_until.get(e, 0.0) > now, self._in_flight.get(e, 0)),
        )

    @contextmanager
    def attempt(self, engine: str) -> Iterator[None]:
        """Count a request in flight to ``engine`` for the block's duration."""
        self._in_flight[engine] = self._in_flight.get(engine, 0) + 1
        try:
            yield
        finally:
            self._in_flight[engine] -= 1
            if self._in_flight[engine] == 0 and engine not in self._engines:
                del self._in_flight[engine]  # (it left the set)

    def refused(self, engine: str, now: float) -> None:
        """``engine`` refused a connection: try it last for :data:`DOWN_FOR` s."""
        self._down_until[engine] = now + DOWN_FOR
