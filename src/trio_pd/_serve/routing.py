"""Which engine gets a request: fewest in flight, skipping unreachable ones (no I/O).

The proxy asks :meth:`EngineSet.candidates` for the engines to try, in
order, and wraps each attempt in :meth:`EngineSet.attempt` (which counts it
in flight). The order: fewest requests in flight, then a rotating start, so
equal engines share the load and a busy one is passed over; at most
``limit`` of them (``--max-attempts``: a request never walks a long list of
dead engines).

**Memory.** An engine that *refused* a connection (or let none be made in
time) is gone, and the request never reached it: it is left out of the
candidates for a backoff, :data:`BACKOFF_FIRST` s doubled at each refusal in
a row up to :data:`BACKOFF_CAP` s, and tried again only after it (an answer
resets it). So a black-holed engine costs one connect timeout per backoff,
not one per request. When every engine of the role is backing off there is
no candidate (the proxy answers 503 with ``Retry-After``:
:meth:`EngineSet.retry_in`). A slow answer from a busy engine is not a
reason to avoid it, nor to send the same work elsewhere.

**Health.** Each engine's last request is remembered as answered or
failed (:meth:`EngineSet.answered`, :meth:`EngineSet.failed`,
:meth:`EngineSet.refused`); a role whose every engine failed its last
request is :meth:`EngineSet.failing` (``/health`` says so). A failure is
remembered for the engine's backoff (refused) or :data:`FAILED_FOR` s
(anything else), then the engine counts as untried again: a health check
that took the proxy out of a load balancer's rotation cannot keep it out
once the engines are back.

The set can change while the proxy runs (membership on etcd): engines that
leave are no longer offered and their memory is dropped; requests in flight
to them finish on their own.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import httpx2

BACKOFF_FIRST = 1.0
"""Seconds an engine that refused a connection is left out after its first refusal."""

BACKOFF_CAP = 30.0
"""The longest an engine that keeps refusing is left out, in seconds."""

FAILED_FOR = 5.0
"""Seconds a failure other than a refusal counts against the role's health."""


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
    """One role's engines (base URLs), their requests in flight, refusals and last outcomes.

    Trio thread only; times are an argument (any clock).
    """

    def __init__(self, engines: Iterable[str] = ()) -> None:
        self._engines: list[str] = []
        self._in_flight: dict[str, int] = {}
        self._refusals: dict[str, int] = {}  # (refusals in a row)
        self._down_until: dict[str, float] = {}
        self._failing_until: dict[str, float] = {}  # (absent: answered, or not tried yet)
        self._turn = itertools.count()
        self.update(engines)

    @property
    def engines(self) -> list[str]:
        return list(self._engines)

    def update(self, engines: Iterable[str]) -> None:
        """Serve these engines from now on (the state of those that stay is kept)."""
        self._engines = list(dict.fromkeys(engines))
        for engine in self._engines:
            self._in_flight.setdefault(engine, 0)
        for memory in (self._refusals, self._down_until, self._failing_until):
            for engine in [e for e in memory if e not in self._engines]:
                del memory[engine]

    def in_flight(self, engine: str) -> int:
        return self._in_flight.get(engine, 0)

    def candidates(self, now: float, limit: int | None = None) -> list[str]:
        """The engines to try, in order (see the module docstring): those not
        backing off, at most ``limit``."""
        if not self._engines:
            return []
        start = next(self._turn) % len(self._engines)
        rotated = self._engines[start:] + self._engines[:start]
        up = [e for e in rotated if self._down_until.get(e, 0.0) <= now]
        up.sort(key=lambda e: self._in_flight.get(e, 0))
        return up[:limit]

    def retry_in(self, now: float) -> float:
        """Seconds until the first engine backing off is tried again (0: one is up)."""
        if not self._engines:
            return 0.0
        return max(0.0, min(self._down_until.get(e, 0.0) for e in self._engines) - now)

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

    def refused(self, engine: str, now: float) -> float:
        """``engine`` refused a connection: leave it out for its backoff
        (returned, in seconds)."""
        if engine not in self._engines:
            return 0.0
        refusals = self._refusals.get(engine, 0) + 1
        self._refusals[engine] = refusals
        backoff = float(min(BACKOFF_CAP, BACKOFF_FIRST * 2.0 ** min(refusals - 1, 32)))
        self._down_until[engine] = self._failing_until[engine] = now + backoff
        return backoff

    def answered(self, engine: str) -> None:
        """``engine`` answered its request (whatever the answer said about the request)."""
        if engine in self._engines:
            self._refusals.pop(engine, None)
            self._down_until.pop(engine, None)
            self._failing_until.pop(engine, None)

    def failed(self, engine: str, now: float) -> None:
        """``engine`` failed a request it was sent (a 5xx, a timeout, a broken
        connection, an answer that cannot be used): not left out (it may be
        busy), but it counts against the role's health for :data:`FAILED_FOR` s."""
        if engine in self._engines:
            until = max(self._failing_until.get(engine, 0.0), now + FAILED_FOR)
            self._failing_until[engine] = until

    def failing(self, now: float) -> bool:
        """Whether the role has engines and every one failed its last request
        (a failure remembered for a while: see the module docstring)."""
        return bool(self._engines) and all(
            self._failing_until.get(e, -math.inf) > now for e in self._engines
        )
