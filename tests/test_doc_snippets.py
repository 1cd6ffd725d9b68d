"""Every ```python block of README.md and docs/*.md runs or type-checks.

A snippet is one of two kinds, said by an HTML comment on the line before its
fence (invisible on the rendered page and on GitHub):

``<!-- snippet: run -->``
    Self-contained: it is executed (a fresh interpreter, 60 s at most) and
    must exit 0. It is type-checked too.
``<!-- snippet: check; given NAME, NAME -->`` (or no comment: nothing given)
    It needs a cluster, engines or tensors, so it is not run; it is
    type-checked with mypy against this checkout's ``trio_pd``. The
    ``given`` names are what the snippet assumes its reader has (``kv_caches``,
    the keys): they are declared ``Any``; ``trio`` and ``trio_pd`` are
    imported; every other name must exist. The body
    is checked inside an ``async def``, so a snippet may ``await`` or ``async
    with`` at its top level, as in a reader's task.

mypy runs once over every snippet (and two planted wrong ones, which must
fail: the check would otherwise pass whatever the pages say).

Shell blocks (```sh, ```bash, ```shell, ```console) are not run; the commands
in them are checked (see "shell blocks" below): ``trio-pd`` lines parse with
the real parsers, ``nox -s`` names sessions that exist, scripts exist.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from trio_pd._cli import _parser

from .test_doc_claims import command_parsers

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^\s*<!-- snippet: (run|check)(?:; given ([\w, ]+))? -->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(\S*)")


@attrs.frozen
class Snippet:
    page: str
    line: int  # of the fence
    code: str
    run: bool
    given: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def module(self) -> str:
        return "snippet_" + re.sub(r"\W", "_", self.page.removesuffix(".md")) + f"_{self.line}"


def snippets(page: str, text: str) -> Iterator[Snippet]:
    """The ```python blocks of a page, with the marker before each."""
    lines = text.splitlines()
    number = 0
    while number < len(lines):
        fence = FENCE.match(lines[number])
        if not fence:
            number += 1
            continue
        _, mark, info = fence.groups()
        end = number + 1
        while end < len(lines) and lines[end].strip() != mark:
            end += 1
        if info == "python":
            marker = MARKER.match(lines[number - 1]) if number else None
            given = marker.group(2) if marker and marker.group(2) else ""
            yield Snippet(
                page=page,
                line=number + 1,
                code=textwrap.dedent("\n".join(lines[number + 1 : end])) + "\n",
                run=bool(marker) and marker.group(1) == "run",
                given=tuple(n.strip() for n in given.split(",") if n.strip()),
            )
        number = end + 1


def all_snippets() -> list[Snippet]:
    return [s for page in PAGES for s in snippets(page.name, page.read_text(encoding="utf-8"))]


# ---- type-checking: one mypy run over every snippet --------------------------------

PRELUDE = "from typing import Any\n"
CONTEXT = "import trio\nimport trio_pd\n"  # what the pages around a check-only snippet import
WRAPPER = "async def _snippet() -> None:\n"

MYPY_CONFIG = """\
[mypy]
python_version = 3.11
check_untyped_defs = True
follow_imports = silent
warn_unused_ignores = False
[mypy-nixl.*,nixl_cu12.*,nixl_cu13.*,torch.*]
follow_imports = skip
ignore_missing_imports = True
[mypy-trio_util.*]
ignore_missing_imports = True
"""


def as_module(snippet: Snippet) -> tuple[str, int]:
    """The module mypy checks, and how many lines precede the snippet's first."""
    head = PRELUDE + ("" if snippet.run else CONTEXT)
    head += "".join(f"{name}: Any\n" for name in snippet.given)
    if snippet.run:  # as it runs, at module level
        return head + snippet.code, head.count("\n")
    body = textwrap.indent(snippet.code, "    ") + "    pass\n"
    return head + WRAPPER + body, head.count("\n") + 1


def type_check(checked: list[Snippet], folder: Path) -> dict[str, list[str]]:
    """mypy's errors for each snippet (by name), at the page's line numbers."""
    offsets = {}
    for snippet in checked:
        source, offset = as_module(snippet)
        (folder / f"{snippet.module}.py").write_text(source)
        offsets[snippet.module] = (snippet, offset)
    (folder / "mypy.ini").write_text(MYPY_CONFIG)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--config-file",
            str(folder / "mypy.ini"),
            "--cache-dir",
            str(ROOT / ".mypy_cache" / "snippets"),
            "--no-error-summary",
            "--show-error-codes",
            *(f"{module}.py" for module in offsets),
        ],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MYPYPATH": str(ROOT / "src")},
        check=False,
    )
    assert "No module named mypy" not in result.stderr, "mypy is missing (the test extra has it)"
    errors: dict[str, list[str]] = {s.name: [] for s in checked}
    for line in result.stdout.splitlines():
        where = re.match(r"(snippet_\w+)\.py:(\d+): (error|note): (.*)", line)
        if not where:
            assert not line.strip(), f"unexpected mypy output: {line}\n{result.stderr}"
            continue
        if where.group(3) != "error":
            continue
        snippet, offset = offsets[where.group(1)]
        page_line = snippet.line + int(where.group(2)) - offset
        errors[snippet.name].append(f"{snippet.page}:{page_line}: {where.group(4)}")
    assert result.returncode in (0, 1), result.stderr
    return errors


# Two wrong snippets, checked in the same run: a name that does not exist in
# trio_pd, and a method called with an argument it does not take.
PLANTED = [
    Snippet("planted.md", 1, "import trio_pd\nconfig = trio_pd.ConectorConfig()\n", False, ()),
    Snippet(
        "planted.md",
        10,
        "async with trio_pd.open_connector('p', caches) as conn:\n"
        "    conn.expose('r', block_ids=[1], readers=2)\n",
        False,
        ("caches",),
    ),
]


def test_every_snippet_type_checks_and_planted_errors_are_found(tmp_path: Path) -> None:
    """One mypy run (about 7 s of CPU) for the pages' snippets and the two planted
    wrong ones: one test, so that two xdist workers never both run it."""
    errors = type_check([*all_snippets(), *PLANTED], tmp_path)
    problems = [e for s in all_snippets() for e in errors[s.name]]
    assert not problems, "\n".join(problems)
    # The check can fail: a wrong name and a wrong argument are found.
    wrong_name, wrong_argument = (errors[s.name] for s in PLANTED)
    assert len(wrong_name) == 1, wrong_name
    assert 'planted.md:3: Module has no attribute "ConectorConfig"' in wrong_name[0]
    assert len(wrong_argument) == 1, wrong_argument
    assert 'planted.md:12: Unexpected keyword argument "readers"' in wrong_argument[0]


# ---- running the self-contained ones ----------------------------------------------------


def run(snippet: Snippet) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", snippet.code],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            **os.environ,
            "NIXL_LOG_LEVEL": "WARN",
            "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        },
        check=False,
    )


@pytest.mark.parametrize("snippet", [s for s in all_snippets() if s.run], ids=lambda s: s.name)
def test_each_self_contained_snippet_runs(snippet: Snippet) -> None:
    result = run(snippet)
    assert result.returncode == 0, f"{snippet.name}:\n{result.stderr}"


def test_a_failing_snippet_fails() -> None:
    assert run(Snippet("planted.md", 1, "import trio_pd.testing.nope\n", True, ())).returncode


def test_the_pages_have_snippets_of_both_kinds() -> None:
    found = all_snippets()
    assert len(found) >= 4
    assert any(s.run for s in found)
    assert any(not s.run for s in found)
    # a marker typo would silently make a snippet check-only
    for page in PAGES:
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
            if "<!-- snippet" in line:
                assert MARKER.match(line), f"{page.name}:{number}: {line}"


def test_the_extraction_reads_markers_fences_and_indentation() -> None:
    page = (
        "text\n\n<!-- snippet: run -->\n```python\nprint(1)\n```\n\n"
        "* item\n\n  <!-- snippet: check; given a, b -->\n  ```python\n  a.b(b)\n  ```\n"
        "```text\nnot python\n```\n"
    )
    assert list(snippets("p.md", page)) == [
        Snippet("p.md", 4, "print(1)\n", True, ()),
        Snippet("p.md", 11, "a.b(b)\n", False, ("a", "b")),
    ]


# ---- shell blocks: the commands they name exist ----------------------------------------
#
# ```sh, ```bash, ```shell and ```console blocks are not run (they start
# servers, need root or another host); each command in them is checked
# instead: a ``trio-pd`` command line is parsed by the real argparse parsers
# (nothing runs) and may name only flags that exist, spelled out; ``nox -s X``
# names a session of the noxfile (anywhere on a page, prose too); ``python
# path.py`` and ``nox -s tests -- path`` name files of this checkout.

SHELL = {"sh", "bash", "shell", "console"}
OPERATORS = {";", "&&", "||", "|", "&", "(", ")"}
REDIRECTS = {">", ">>", "<", "2>", "&>", ">&"}


def shell_blocks(page: str, text: str) -> Iterator[tuple[str, int, list[str]]]:
    """(page, line of the first line, lines) of each shell block of a page.
    In a ``console`` block only the ``$ `` lines are commands (the rest is output)."""
    lines = text.splitlines()
    number = 0
    while number < len(lines):
        fence = FENCE.match(lines[number])
        if not fence:
            number += 1
            continue
        indent, mark, info = fence.groups()
        end = number + 1
        while end < len(lines) and lines[end].strip() != mark:
            end += 1
        if info in SHELL:
            body = [line.removeprefix(indent) for line in lines[number + 1 : end]]
            if info == "console":
                body = [line[2:] if line.startswith("$ ") else "" for line in body]
            yield page, number + 2, body
        number = end + 1


def shell_commands(first: int, body: list[str]) -> Iterator[tuple[int, list[str]]]:
    """(line, argv) of each simple command of a block: continuations joined,
    comments, ``VAR=value`` prefixes, ``sudo`` and redirections dropped, split
    at ``;``, ``&&``, ``||``, ``|`` and ``&``."""
    number = 0
    while number < len(body):
        start, line = number, body[number]
        while line.endswith("\\") and number + 1 < len(body):
            number += 1
            line = line[:-1] + " " + body[number]
        number += 1
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        argv: list[str] = []
        tokens = list(lexer)
        skip = False
        for token in [*tokens, ";"]:
            if skip:
                skip = False
            elif token in REDIRECTS:
                skip = True  # (and its target)
            elif token in OPERATORS:
                while argv and (re.fullmatch(r"\w+=.*", argv[0]) or argv[0] == "sudo"):
                    argv.pop(0)
                if argv:
                    yield first + start, argv
                argv = []
            else:
                argv.append(token)


def nox_sessions() -> set[str]:
    """The noxfile's sessions (read, not imported: nox need not be installed)."""
    tree = ast.parse((ROOT / "noxfile.py").read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        and any("nox.session" in ast.unparse(d) for d in node.decorator_list)
    }


def parse_problem(argv: list[str]) -> str | None:
    """Why the real ``trio-pd`` parser refuses ``argv`` (the words after
    ``trio-pd``), or a flag it would take only abbreviated; ``None`` if it parses."""
    parsers = command_parsers()
    if argv and argv[0] in parsers:
        flags = {option for action in parsers[argv[0]]._actions for option in action.option_strings}
        for word in argv[1:]:
            if word == "--":
                break
            if word.startswith("--") and word.split("=")[0] not in flags:
                return f"trio-pd {argv[0]} has no {word.split('=')[0]}"
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(io.StringIO()):
            _parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            return said.getvalue().strip().splitlines()[-1]
    return None


def command_problems(argv: list[str]) -> list[str]:
    """What in one shell command names something that does not exist."""
    shown = " ".join(argv)
    if argv[:3] == ["python", "-m", "trio_pd"]:
        argv = ["trio-pd", *argv[3:]]
    if argv[0] == "trio-pd":
        problem = parse_problem(argv[1:])
        return [f"{shown!r}: {problem}"] if problem else []
    if argv[:2] == ["nox", "-s"] and len(argv) > 2:
        session, rest = argv[2], argv[3:]
        if session not in nox_sessions():
            return [f"{shown!r}: the noxfile has no session {session!r}"]
        posargs = rest[rest.index("--") + 1 :] if "--" in rest else []
        if session == "demo":  # (nox -s demo -- ARGS runs trio-pd demo ARGS)
            problem = parse_problem(["demo", *posargs])
            return [f"{shown!r}: {problem}"] if problem else []
        if session == "tests":
            paths = [p.split("::")[0] for p in posargs if p.startswith("tests/")]
            return [f"{shown!r}: no file {p}" for p in paths if not (ROOT / p).exists()]
        return []
    if argv[0] in ("python", "python3") and len(argv) > 1 and argv[1].endswith(".py"):
        return [] if (ROOT / argv[1]).is_file() else [f"{shown!r}: no file {argv[1]}"]
    return []


NOX_IN_PROSE = re.compile(r"`nox -s (\w+)")


def shell_problems(page: str, text: str) -> tuple[list[str], int]:
    """The problems of a page's shell blocks and ``nox -s`` spans, and how many
    ``trio-pd`` and ``nox`` commands were checked."""
    problems, checked = [], 0
    for _, first, body in shell_blocks(page, text):
        for line, argv in shell_commands(first, body):
            if argv[0] in ("trio-pd", "nox") or argv[:3] == ["python", "-m", "trio_pd"]:
                checked += 1
            problems += [f"{page}:{line}: {p}" for p in command_problems(argv)]
    sessions = nox_sessions()
    for number, line in enumerate(text.splitlines(), 1):
        for session in NOX_IN_PROSE.findall(line):
            checked += 1
            if session not in sessions:
                problems.append(f"{page}:{number}: the noxfile has no session {session!r}")
    return problems, checked


def test_every_shell_command_names_commands_flags_and_sessions_that_exist() -> None:
    problems, checked = [], 0
    for page in PAGES:
        found, count = shell_problems(page.name, page.read_text(encoding="utf-8"))
        problems += found
        checked += count
    assert not problems, "\n".join(problems)
    assert checked >= 25, checked  # (a check that finds no command passes forever)


def test_a_wrong_command_flag_session_or_file_in_a_shell_block_is_found() -> None:
    page = (
        "```sh\n"
        "trio-pd serve --prefill 1 --decod 1 --port 8000 \\\n"
        "    --ready-file r.json &   # a comment --nope\n"
        "sudo TRIO_PD_X=1 trio-pd engin --role prefill > log\n"
        "trio-pd proxy --port 80 --idle 5 && nox -s tset\n"
        "nox -s demo -- --hosts 2 --kill-engine-afterwards 3\n"
        "python docs/examples/nope.py | tee out\n"
        "```\n"
        "```console\n"
        "$ trio-pd engine --role both\n"
        "trio-pd engine --role output-is-not-checked\n"
        "```\n"
        "and in prose, `nox -s lint` and `nox -s lnt`.\n"
    )
    problems, checked = shell_problems("planted.md", page)
    expected = [  # (the start of each problem, and what argparse's own message says)
        ("planted.md:2: 'trio-pd serve --prefill 1 --decod 1 --port 8000 --ready-file r.json'",
         "trio-pd serve has no --decod"),
        ("planted.md:4: 'trio-pd engin --role prefill'", "invalid choice: 'engin'"),
        ("planted.md:5: 'trio-pd proxy --port 80 --idle 5'", "trio-pd proxy has no --idle"),
        ("planted.md:5: 'nox -s tset'", "the noxfile has no session 'tset'"),
        ("planted.md:6: 'nox -s demo -- --hosts 2 --kill-engine-afterwards 3'",
         "trio-pd demo has no --kill-engine-afterwards"),
        ("planted.md:7: 'python docs/examples/nope.py'", "no file docs/examples/nope.py"),
        ("planted.md:10: 'trio-pd engine --role both'", "invalid choice: 'both'"),
        ("planted.md:13:", "the noxfile has no session 'lnt'"),
    ]  # fmt: skip
    assert len(problems) == len(expected), "\n".join(problems)
    for problem, (start, said) in zip(problems, expected, strict=True):
        assert problem.startswith(start), problem
        assert said in problem, problem
    assert checked == 8
