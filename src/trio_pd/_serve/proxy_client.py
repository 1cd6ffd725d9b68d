"""The proxy's HTTP client to the engines, and its per-phase deadlines.

httpx2's own timeouts bound connecting and writing; reads are bounded by the
proxy per phase (:class:`ProxyTimeouts`), so that no read timeout cuts a
long prefill or a slow first token short.
"""

from __future__ import annotations

import attrs
import httpx2

from trio_pd._serve import defaults


@attrs.frozen(kw_only=True)
class ProxyTimeouts:
    """The proxy's per-phase deadlines, in seconds.

    Attributes:
        connect: connecting to an engine (a connection refused or not made
            in time: the next engine is tried); a decode engine's is cut to
            what the exposure's lease leaves (:mod:`.defaults`).
        prefill: the whole prefill request, from sending it to its answer.
        first_byte: a decode request, from sending it until its response
            starts (for a request that does not stream, the whole answer).
        idle: the longest gap between two chunks of a decode stream.
    """

    connect: float = defaults.CONNECT_TIMEOUT
    prefill: float = defaults.PREFILL_TIMEOUT
    first_byte: float = defaults.FIRST_BYTE_TIMEOUT
    idle: float = defaults.IDLE_TIMEOUT


def open_client(timeouts: ProxyTimeouts = ProxyTimeouts()) -> httpx2.AsyncClient:
    """The proxy's HTTP client: no cap on connections (the engines' own
    admission decides what they take). It bounds connecting and writing;
    reads are bounded by the proxy per phase (prefill, first byte, each gap
    in a stream), so no read timeout cuts a phase short."""
    return httpx2.AsyncClient(
        timeout=httpx2.Timeout(connect=timeouts.connect, read=None, write=timeouts.idle, pool=None),
        limits=httpx2.Limits(max_connections=None, max_keepalive_connections=512),
    )
