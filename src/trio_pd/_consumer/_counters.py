"""The consumer's counters: what its handshakes and its pulls count into.

One mutable record per connector, shared by the handshakes
(``_handshakes.Handshakes``) and the pulls (``_pulls.Consumer``), which
turns it into the public :class:`~trio_pd.ConsumerStatistics` snapshot. No
I/O; owned by the consumer, never reset.
"""

from __future__ import annotations

from collections import Counter

import attrs

from trio_pd._core._remote_engine import FailureCause


@attrs.define
class ConsumerCounters:
    """The consumer's counters (the handshakes and the pulls count into one)."""

    handshakes_started: int = 0
    handshakes_succeeded: int = 0
    handshake_failures: Counter[FailureCause] = attrs.field(factory=Counter)
    pulls_succeeded: int = 0
    pulls_failed: int = 0
    pulls_rejected: int = 0
    pulls_exposure_ended: int = 0
    pulls_rejected_in_backoff: int = 0
    restarts_detected: int = 0
    peers_disconnected: int = 0
    bytes_pulled: int = 0
