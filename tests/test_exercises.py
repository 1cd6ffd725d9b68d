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

import re
import subprocess
import sys
from pathlib import Path

import pytest

from trio_pd import exercises

from .conftest import run_doc_script, run_here, run_in_terminal_order, terminal_capture
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
    "write_start.py": ("checkers/started_listener.py", "solutions/write_start.py"),
    "write_handshake.py": ("checkers/one_handshake.py", "solutions/write_handshake.py"),
    "write_cleanup.py": ("checkers/bounded_release.py", "solutions/write_cleanup.py"),
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
    output = _shown(run_here(DOCS / "exercises" / exercise))
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


def _check(
    name: str, *, solution: bool = False, path: Path = DOCS / "exercises"
) -> tuple[int, str]:
    """``python -m trio_pd.exercises check NAME``, in this process: its exit
    status and its output, with the library's warnings where a terminal
    shows them."""
    with terminal_capture(stderr=True) as out:
        argv = ["--path", str(path), "check", name, *(["--solution"] if solution else [])]
        status = exercises.main(argv)
    return status, out.getvalue()


@pytest.mark.parametrize("exercise", sorted(WRITE_CODE))
def test_a_write_the_code_skeleton_fails_its_check_and_its_solution_passes(exercise: str) -> None:
    """The skeleton, as the learner finds it, is not solved (exit 1, "not
    yet: ..."); the solution is (exit 0); both print what the page shows."""
    name = exercise.removeprefix("write_").removesuffix(".py")
    assert "TODO" in (DOCS / "exercises" / exercise).read_text()
    status, output = _check(name)
    assert status == 1, output
    assert "not yet: " in output
    assert _shown(output) in _page(), f"exercises.md does not show:\n{output}"
    status, output = _check(name, solution=True)
    assert status == 0, output
    assert "solved: " in output
    assert "not yet" not in output
    assert _shown(output) in _page(), f"exercises.md does not show:\n{output}"


def test_the_exercises_command_checks_by_name_from_the_root_of_a_checkout() -> None:
    """``python -m trio_pd.exercises check start``, a process of its own run
    where a learner runs it, finds ``docs/exercises/write_start.py`` and fails
    it, saying why."""
    failed = subprocess.run(
        [sys.executable, "-m", "trio_pd.exercises", "check", "start"],
        cwd=DOCS.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "not yet: open_side_channel returned before the listener was bound" in failed.stdout


def test_the_exercises_command_refuses_what_it_cannot_find_and_says_where_it_looks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exercises.main(["--path", str(DOCS / "exercises"), "check", "nope"]) == 2
    said = capsys.readouterr().err
    assert "no exercise 'nope'" in said
    assert "(exercises here: cleanup, deadline, handshake, settled, start)" in said
    monkeypatch.chdir(tmp_path)  # (no docs/exercises here)
    assert exercises.main(["check", "start"]) == 2
    said = capsys.readouterr().err
    assert "run this from the root of a trio_pd checkout, or pass --path DIR" in said
    with pytest.raises(SystemExit):
        exercises.main(["--help"])
    assert "default: docs/exercises under the current directory" in " ".join(
        capsys.readouterr().out.split()
    )
    monkeypatch.chdir(DOCS.parent)
    assert exercises.main(["list"]) == 0
    assert "handshake: docs/exercises/write_handshake.py" in capsys.readouterr().out


HALF_RIGHT = {
    # exercise: (the solution's lines -> a half-right answer's, what the checker says)
    "write_start.py": (
        {"    task_status.started(listener.port)  # ready: nursery.start returns this port\n": ""},
        "not yet: open_side_channel never returned: does serve_metadata call "
        "task_status.started(...) once the listener is bound?",
    ),
    "write_cleanup.py": (
        {"trio.move_on_after(RELEASE_TIMEOUT, shield=True)": "trio.CancelScope(shield=True)"},
        "not yet: with a peer that does not answer, the pull ended at 3600.5 s, not within "
        "1.0 s of its deadline: give the shielded scope a deadline",
    ),
    "write_handshake.py": (
        {
            "        self.failure: dict[str, str] = {}": "        self.failure: dict[str, str] = {}"
            "\n        self.error: dict[str, HandshakeError] = {}",
            "raise HandshakeError(engine, self.failure[engine])": "raise self.error.setdefault("
            "engine, HandshakeError(engine, self.failure[engine]))",
        },
        "not yet: the pulls for prefill-b raised one exception object between them: raise a "
        "HandshakeError of its own in each",
    ),
}


@pytest.mark.parametrize("exercise", sorted(HALF_RIGHT))
def test_a_half_right_answer_fails_and_its_checker_says_what_is_missing(
    exercise: str, tmp_path: Path
) -> None:
    """`start` without `started` (it never returns), a shield without a
    deadline (an hour for a peer that does not answer), one exception object
    raised in every waiter: each is not a solution, and the checker says why."""
    changes, said = HALF_RIGHT[exercise]
    text = (DOCS / "exercises" / "solutions" / exercise).read_text()
    text = text.replace("Path(__file__).resolve().parent.parent", repr(str(DOCS / "exercises")))
    for old, new in changes.items():
        assert old in text, old
        text = text.replace(old, new)
    (tmp_path / "solutions").mkdir()
    (tmp_path / "solutions" / exercise).write_text(text)
    status, output = _check(exercise, solution=True, path=tmp_path)
    assert status == 1, output
    assert said in output, output


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
