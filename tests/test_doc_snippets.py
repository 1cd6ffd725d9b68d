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
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

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


@pytest.fixture(scope="module")
def mypy_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    return type_check([*all_snippets(), *PLANTED], tmp_path_factory.mktemp("snippets"))


def test_every_snippet_type_checks(mypy_errors: dict[str, list[str]]) -> None:
    problems = [e for s in all_snippets() for e in mypy_errors[s.name]]
    assert not problems, "\n".join(problems)


def test_the_type_check_finds_a_wrong_name_and_a_wrong_argument(
    mypy_errors: dict[str, list[str]],
) -> None:
    wrong_name, wrong_argument = (mypy_errors[s.name] for s in PLANTED)
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
