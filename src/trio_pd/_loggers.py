"""Every logger trio_pd logs to, and what each one logs.

This is the one list: each ``logging.getLogger(...)`` in ``src/trio_pd`` names
a key of :data:`LOGGERS` (``tests/test_loggers.py`` greps for them), and the
table in ``docs/operations.md`` is rendered from it (the ``loggers``
directive of ``docs/_ext/pd_facts.py``, which fails the build when a logger
the code uses is missing here, or one listed here is used nowhere).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
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

_GET_LOGGER = re.compile(r"logging\.getLogger\(([^)]*)\)")


def loggers_used(root: Path | None = None) -> dict[str, list[str]]:
    """Each name passed to ``logging.getLogger`` under ``root`` (the package's
    sources by default) -> the files that pass it, relative to ``root``.

    An argument that is not a string literal is listed as written (``__name__``),
    so a check against :data:`LOGGERS` fails on it rather than missing it.
    """
    this = Path(__file__).resolve()
    root = root or this.parent
    used: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        if path.resolve() == this:  # this module names getLogger only in its text
            continue
        for argument in _GET_LOGGER.findall(path.read_text(encoding="utf-8")):
            name = argument.strip()
            if len(name) >= 2 and name[0] == name[-1] and name[0] in "\"'":
                name = name[1:-1]
            used.setdefault(name, []).append(str(path.relative_to(root)))
    return used


def unlisted_or_unused(root: Path | None = None) -> list[str]:
    """What is wrong with :data:`LOGGERS` against the sources (empty: nothing)."""
    used = loggers_used(root)
    problems = [
        f"logging.getLogger({name}) in {', '.join(files)} is not in trio_pd._loggers.LOGGERS"
        for name, files in used.items()
        if name not in LOGGERS
    ]
    problems += [
        f"trio_pd._loggers.LOGGERS lists {name!r}, which no getLogger call uses"
        for name in LOGGERS
        if name not in used
    ]
    return problems
