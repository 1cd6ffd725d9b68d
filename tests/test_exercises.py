"""The exercises of docs/exercises.md run and print what the page shows.

The *Write it* exercises (``WRITE_CODE``) are a skeleton with a TODO, a
checker and a solution: the skeleton as shipped must fail its check, the
solution must pass it.

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

from .conftest import run_doc_script, run_in_terminal_order
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
# exercises where the learner writes code: the skeleton, its checker and a solution
WRITE_CODE = {
    "write_deadline.py": ("checkers/per_request_deadline.py", "solutions/write_deadline.py"),
    "write_settled.py": ("checkers/free_when_settled.py", "solutions/write_settled.py"),
}
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
    exercises = DOCS / "exercises"
    assert {p.name for p in exercises.glob("*.py")} == {*IN_MEMORY, *ON_TEST_HOSTS, *WRITE_CODE}
    text = PAGE.read_text()
    for exercise in [*IN_MEMORY, *ON_TEST_HOSTS, *WRITE_CODE]:
        assert f"{{literalinclude}} exercises/{exercise}" in text, exercise
    helpers = {path for pair in WRITE_CODE.values() for path in pair}
    assert {str(p.relative_to(exercises)) for p in exercises.glob("*/*.py")} == helpers
    for checker, solution in WRITE_CODE.values():
        assert f"{{literalinclude}} exercises/{solution}" in text, solution
        assert f"docs/exercises/{checker}" in text, checker


def _run(path: Path) -> tuple[int, str]:
    return run_in_terminal_order(path, timeout=120)


@pytest.mark.parametrize("exercise", sorted(WRITE_CODE))
def test_a_write_the_code_skeleton_fails_its_check_and_its_solution_passes(
    exercise: str, tmp_path: Path
) -> None:
    """The skeleton, as the learner finds it, is not solved (exit 1, "not
    yet: ..."); the solution is (exit 0); both print what the page shows."""
    _, solution = WRITE_CODE[exercise]
    status, output = _run(DOCS / "exercises" / exercise)
    assert status == 1, output
    assert "not yet: " in output
    assert _shown(output) in _page(), f"exercises.md does not show:\n{output}"
    status, output = _run(DOCS / "exercises" / solution)
    assert status == 0, output
    assert "solved: " in output
    assert _shown(output) in _page(), f"exercises.md does not show:\n{output}"


def test_the_deadline_checker_names_an_error_that_escapes_a_request(tmp_path: Path) -> None:
    """A deadline per request that is not caught is not a solution: the checker says why."""
    wrong = (DOCS / "exercises" / "solutions" / "write_deadline.py").read_text()
    wrong = wrong.replace("Path(__file__).resolve().parent.parent", repr(str(DOCS / "exercises")))
    start, end = wrong.index("    try:\n"), wrong.index("\n\nif __name__")
    body = "    with trio.fail_after(DEADLINE):\n        return await cluster.request(request_id)"
    (tmp_path / "wrong.py").write_text(wrong[:start] + body + wrong[end:])
    status, output = _run(tmp_path / "wrong.py")
    assert status == 1, output
    assert "not yet: TooSlowError escaped a request's task" in output
