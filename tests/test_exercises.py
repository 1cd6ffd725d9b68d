"""The exercises of docs/exercises.md run and print what the page shows.

They use the in-memory data plane (``trio_pd.testing.MemoryFabric``), so they
run in this process, each in about a second. The partition exercise needs
root and test hosts: it runs only with ``TRIO_PD_EXERCISE_HOSTS=1`` (otherwise
it is deselected, not skipped; see ``conftest.py``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import runpy
from pathlib import Path

import pytest

from .conftest import run_doc_script
from .test_docs import _normalized

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGE = DOCS / "exercises.md"
IN_MEMORY = [
    "nesting.py",
    "deadlines.py",
    "stuck_load.py",
    "peer_killed.py",
    "cancel_mid_transfer.py",
    "forged_params.py",
]
ON_TEST_HOSTS = ["partition.py"]
# an agent's name ends with its connector's random incarnation
INCARNATION = (re.compile(r"#[0-9a-f]{16}"), "#INCARNATION")


def _shown(output: str) -> str:
    pattern, replacement = INCARNATION
    return pattern.sub(replacement, _normalized(output)).strip()


def _page() -> str:
    return _shown(PAGE.read_text())


@pytest.mark.parametrize("exercise", IN_MEMORY)
def test_each_exercise_prints_what_its_page_shows(exercise: str) -> None:
    out = io.StringIO()
    # the library's warnings where a terminal shows them, between the lines
    # printed, as Python's last-resort handler writes them (message only)
    handler = logging.StreamHandler(out)
    handler.setLevel(logging.WARNING)
    library = logging.getLogger("trio_pd")
    library.addHandler(handler)
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(str(DOCS / "exercises" / exercise), run_name="__main__")
    finally:
        library.removeHandler(handler)
    output = _shown(out.getvalue())
    assert output
    assert output in _page(), f"exercises.md does not show the output of {exercise}:\n{output}"


@pytest.mark.exercise_hosts
@pytest.mark.test_hosts
@pytest.mark.parametrize("exercise", ON_TEST_HOSTS)
def test_each_exercise_on_test_hosts_prints_what_its_page_shows(exercise: str) -> None:
    output = _shown(run_doc_script(DOCS / "exercises" / exercise, timeout=120))
    assert output
    assert output in _page(), f"exercises.md does not show the output of {exercise}:\n{output}"


def test_every_exercise_is_tested_and_included_in_the_page() -> None:
    assert {p.name for p in (DOCS / "exercises").glob("*.py")} == {*IN_MEMORY, *ON_TEST_HOSTS}
    text = PAGE.read_text()
    for exercise in [*IN_MEMORY, *ON_TEST_HOSTS]:
        assert f"{{literalinclude}} exercises/{exercise}" in text, exercise
