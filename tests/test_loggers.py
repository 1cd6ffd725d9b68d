"""Every logger trio_pd uses is in one list, :data:`trio_pd._loggers.LOGGERS`,
which ``docs/operations.md`` renders; the check that reads the sources is
``docs/_ext/pd_loggers.py`` (the docs build runs it too)."""

from __future__ import annotations

import sys
from pathlib import Path

import trio_pd._loggers as loggers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import pd_loggers  # noqa: E402


def test_every_getlogger_in_the_sources_names_a_listed_logger() -> None:
    used = pd_loggers.loggers_used()
    assert "trio_pd.proxy" in used  # the check finds the calls
    assert pd_loggers.unlisted_or_unused() == []


def test_an_unlisted_or_computed_logger_is_reported(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text(
        'import logging\nlog = logging.getLogger("trio_pd.elsewhere")\n'
        "other = logging.getLogger(__name__)\n"
        '"""Text that names logging.getLogger("trio_pd.in_a_docstring") calls nothing."""\n'
    )
    problems = pd_loggers.unlisted_or_unused(tmp_path)
    assert any("getLogger(trio_pd.elsewhere) in a.py" in p for p in problems), problems
    assert any("getLogger(__name__) in a.py" in p for p in problems), problems
    assert not any("in_a_docstring" in p for p in problems), problems
    # and every listed logger is unused there
    assert sum("which no getLogger call uses" in p for p in problems) == len(loggers.LOGGERS)
