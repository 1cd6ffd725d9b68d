"""Every logger trio_pd logs to, and what each one logs.

This is the one list: each ``getLogger`` call in ``src/trio_pd`` names a key
of :data:`LOGGERS`, and the table in ``docs/operations.md`` is rendered from
it. The library does not read its own sources: ``docs/_ext/pd_loggers.py``
checks the list against them, for ``tests/test_loggers.py`` and for the
``loggers`` directive of ``docs/_ext/pd_facts.py`` (which fails the build
when a logger the code uses is missing here, or one listed here is used
nowhere).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

LOGGERS: Mapping[str, str] = MappingProxyType(
    {
        "trio_pd": (
            "the connector: opening, handshakes (started, ready, failed and the backoff, "
            "restarts), lost peers, exposures that expired, notifications ignored, "
            "refused consumers"
        ),
        "trio_pd.nixl": (
            "the NIXL backend and its transfer driver: remote agents removed or used again, "
            "transfers that would not stop, handles NIXL refused to release, errors at close"
        ),
        "trio_pd.serve": (
            "the engines of ``trio-pd engine`` and ``serve``: requests "
            "(``request ID: ...``, with the ``X-Request-Id``), their errors, the connector "
            "failing, blocks kept out of the pool"
        ),
        "trio_pd.proxy": (
            "the proxy of ``trio-pd proxy`` and ``serve``: its failed requests "
            "(``request ID: STATUS why``, with the ``X-Request-Id``)"
        ),
        "trio_pd.membership": (
            "etcd: an engine's registration (lost, renewed, withdrawn) and the proxy's "
            "view of the members (lost, back, bad values)"
        ),
    }
)
"""Logger name -> what it logs (inline reST: ``literal``)."""
