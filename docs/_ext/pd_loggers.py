"""The check that :data:`trio_pd._loggers.LOGGERS` is the list of the loggers
the sources use: each ``logging.getLogger`` call under ``src/trio_pd`` names a
listed logger, and each listed logger is named by one.

It reads the repository's sources (parsed with :mod:`ast`, nothing is
imported), so it lives here, next to the docs extensions, and not in the
library: ``pd_facts`` fails the build on what it finds (the ``loggers``
directive), and ``tests/test_loggers.py`` and ``tests/test_docs.py`` import it
(``sys.path``, as ``tests/test_layers.py`` imports ``pd_packages``).
"""

from __future__ import annotations

import ast
from pathlib import Path

from trio_pd._loggers import LOGGERS

SOURCES = Path(__file__).resolve().parents[2] / "src" / "trio_pd"


def _logger_names(text: str) -> list[str]:
    """The first argument of each ``getLogger(...)`` call in ``text``: a string
    literal's value, anything else as written (``__name__``); ``""`` for none."""
    names = []
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if called != "getLogger":
            continue
        if not node.args:
            names.append("")
        elif isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
            names.append(node.args[0].value)
        else:
            names.append(ast.unparse(node.args[0]))
    return names


def loggers_used(root: Path = SOURCES) -> dict[str, list[str]]:
    """Each name passed to ``getLogger`` under ``root`` (trio_pd's sources by
    default) -> the files that pass it, relative to ``root``.

    An argument that is not a string literal is listed as written (``__name__``),
    so a check against :data:`LOGGERS` fails on it rather than missing it.
    """
    used: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        for name in _logger_names(path.read_text(encoding="utf-8")):
            used.setdefault(name, []).append(str(path.relative_to(root)))
    return used


def unlisted_or_unused(root: Path = SOURCES) -> list[str]:
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
