"""``Server-Timing``: how long a request's phases took, in its response's headers.

An engine's answer names the phases it ran before the answer started: a
prefill engine's ``admission`` (waiting for free KV blocks), ``forward`` (the
prompt's KV computed) and ``expose``; a decode engine's ``hold``,
``admission`` and ``pull`` (``admission`` and ``forward`` for a request it
serves whole). The proxy adds its own two -- ``prefill``, its request to the
prefill engine, and ``decode``, from sending the decode request until that
answer started -- and relays each engine's phases under the prefix
``prefill.`` or ``decode.``. So a client (or the benchmark) can tell where
the time to the first token went without reading any log.

Durations are wall-clock milliseconds (``name;dur=1.234``, W3C Server
Timing). No I/O here.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

HEADER = b"server-timing"

_ENTRY = re.compile(r"\s*([!#$%&'*+\-.^_`|~0-9A-Za-z]+)\s*;\s*dur\s*=\s*([0-9]+(?:\.[0-9]+)?)\s*")


class PhaseTimes:
    """The durations of one request's phases, in the order they ran.

    ``clock`` (seconds) is :func:`time.perf_counter` unless a test passes one.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._ms: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase ``name`` (added to it if it ran before),
        however the block ends."""
        started = self._clock()
        try:
            yield
        finally:
            self.add(name, (self._clock() - started) * 1e3)

    def clock(self) -> float:
        """Now, in seconds, on this object's clock (for a phase whose start and
        end are in different places: :meth:`add` its length)."""
        return self._clock()

    def add(self, name: str, ms: float) -> None:
        """Add ``ms`` milliseconds to phase ``name``."""
        self._ms[name] = self._ms.get(name, 0.0) + ms

    def relay(self, prefix: str, value: str | None) -> None:
        """Add another server's phases (its ``Server-Timing`` header ``value``),
        each name prefixed with ``prefix``; entries that do not parse are skipped."""
        for name, ms in parse(value or "").items():
            self.add(f"{prefix}{name}", ms)

    def as_dict(self) -> dict[str, float]:
        """Each phase's milliseconds, by name."""
        return dict(self._ms)

    def header(self) -> tuple[bytes, bytes]:
        """The ``Server-Timing`` header (name and value, ASGI style)."""
        value = ", ".join(f"{name};dur={ms:.3f}" for name, ms in self._ms.items())
        return HEADER, value.encode()


def parse(value: str) -> dict[str, float]:
    """The ``name;dur=ms`` entries of a ``Server-Timing`` value, by name.

    Entries without a duration, or that are not of this simple form, are
    skipped (a relay must not fail on another server's header).
    """
    out: dict[str, float] = {}
    for entry in value.split(","):
        match = _ENTRY.fullmatch(entry)
        if match is not None:
            out[match[1]] = float(match[2])
    return out
