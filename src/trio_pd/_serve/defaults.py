"""The serving deployment's default deadlines, chosen together (no I/O).

The engines' (``trio-pd engine``, :class:`~.engine.EngineSettings`) and the
proxy's (``trio-pd proxy``, :class:`~.proxy.ProxyTimeouts`) defaults
depend on each other, so they live here, in one place, and
``docs/timeouts.md`` has them in one table (``tests/test_proxy.py`` checks
that the table says what this module says, and that the rule below holds).

The rule that ties them: a prefill engine's exposure waits
:data:`LEASE_INITIAL` for a decode engine's first heartbeat (its *hold*).
Blocks whose lease ran out may be reused for another request, so a decode
engine that reads them late would decode someone else's KV. The proxy
therefore starts a decode request only while the lease, counted from the
prefill's answer, still covers connecting to the decode engine
(:data:`CONNECT_TIMEOUT` at most, cut to what the lease leaves) and
:data:`HOLD_MARGIN` more for the decode engine to read the request and send
its first heartbeat; otherwise it prefills again (once). The defaults
leave room for :func:`decode_attempts` connections that time out before the
proxy prefills again: 2 (a decode engine that does not answer, then
another).
"""

from __future__ import annotations

import math
from typing import Final

# ---- the engines -------------------------------------------------------------

LEASE_INITIAL: Final = 5.0
"""How long a prefill engine keeps an exposure that no decode engine holds yet
(``--lease-initial``; the connector's ``lease_initial``). Also what the proxy
assumes when a prefill answer does not say (``remote_lease_initial``)."""

LEASE_RENEWAL: Final = 3.0
"""A held exposure's lease after each heartbeat (``lease_renewal``)."""

HEARTBEAT_INTERVAL: Final = 1.0
"""How often a decode engine renews what it holds (``heartbeat_interval``):
3 heartbeats may be lost in a row before a held exposure expires."""

ABORT_TIMEOUT: Final = 30.0
"""The longest a prefill engine keeps an exposure, however often renewed."""

ADMISSION_TIMEOUT: Final = 10.0
"""How long a request waits for free KV blocks (then 503; ``--admission-timeout``)."""

GRACE: Final = 10.0
"""How long requests in flight may finish after SIGTERM (``--grace``)."""

SEND_TIMEOUT: Final = 30.0
"""How long an answer may wait for a client that stopped reading (``--send-timeout``)."""

# ---- the proxy ----------------------------------------------------------------

CONNECT_TIMEOUT: Final = 2.0
"""Connecting to an engine (``--connect-timeout``); a decode engine's is also
cut to what the exposure's lease leaves (see the module docstring)."""

HOLD_MARGIN: Final = 1.0
"""What the proxy leaves of an exposure's lease, after connecting, for the
decode engine to read the request and send its first heartbeat."""

PREFILL_TIMEOUT: Final = 60.0
"""A whole prefill request (``--prefill-timeout``)."""

FIRST_BYTE_TIMEOUT: Final = 120.0
"""A decode request until its answer starts (``--first-byte-timeout``)."""

IDLE_TIMEOUT: Final = 60.0
"""The longest gap in a decode stream (``--idle-timeout``)."""

REPREFILLS: Final = 1
"""How many times the proxy prefills a request again (its exposure ended, or
too little of its lease was left for another decode engine): once."""


def check_lease(lease_initial: float, connect_timeout: float, hold_margin: float) -> None:
    """Raises ValueError unless a decode can start within ``lease_initial``:
    ``connect_timeout`` and ``hold_margin`` positive and finite, and the
    margin below the lease (or the proxy would prefill again forever, once)."""
    for name, value in (
        ("lease_initial", lease_initial),
        ("connect_timeout", connect_timeout),
        ("hold_margin", hold_margin),
    ):
        if not (value > 0 and math.isfinite(value)):
            raise ValueError(f"{name} must be a positive number of seconds (got {value!r})")
    if hold_margin >= lease_initial:
        raise ValueError(
            f"the hold margin ({hold_margin:g} s) must be below the exposure's lease "
            f"({lease_initial:g} s): no decode request could ever start"
        )


def check_admission(admission_timeout: float, abort_timeout: float) -> None:
    """Raises ValueError unless ``admission_timeout`` is a positive number of
    seconds, at most ``abort_timeout``: a decode request holds its prefill's
    exposure while it waits for blocks, and a wait past the exposure's cap
    would end in ``exposure_ended`` rather than a pull."""
    if not (admission_timeout > 0 and math.isfinite(admission_timeout)):
        raise ValueError(
            f"--admission-timeout must be a positive number of seconds (got {admission_timeout!r})"
        )
    if admission_timeout > abort_timeout:
        raise ValueError(
            f"--admission-timeout ({admission_timeout:g} s) must be at most the exposure's cap "
            f"({abort_timeout:g} s): a decode request waiting longer would find its "
            "prefill's exposure ended"
        )


def decode_attempts(lease_initial: float, connect_timeout: float, hold_margin: float) -> int:
    """How many decode engines the proxy can try, each timing out its
    connection, before an exposure's lease is too short for another."""
    return max(0, math.ceil((lease_initial - hold_margin) / connect_timeout))


MAX_ATTEMPTS: Final = 3
"""The most engines of a role one request tries (the proxy's ``--max-attempts``;
a decode-first engine's prefill engines too)."""

SERVER_KEEP_ALIVE: Final = 5.0
"""Seconds an engine's (and the proxy's) HTTP server keeps an idle
connection open (hypercorn's ``keep_alive_timeout``, set to this)."""

CLIENT_KEEP_ALIVE: Final = 2.0
"""Seconds the proxy's and a decode-first engine's HTTP clients keep an idle
connection to an engine: less than :data:`SERVER_KEEP_ALIVE`, so that a
client never sends a request on a connection the server is closing (with
both at 5 s, a decode request after an idle spell failed with "Server
disconnected without sending a response", and a decode request is not
retried: benchmark 11's full run, issue 33)."""
