"""The numbers and names the docs copy from the code still agree with it.

A fast check (no build, no process): it reads ``docs/*.md`` and ``README.md``
and compares, wherever a page states one,

* the side-channel protocol version with ``_protocol.PROTOCOL_VERSION``;
* a ``ConnectorConfig`` default stated next to its field name ("`handshake_timeout`
  (default 5 s)", "`max_bytes_per_transfer` (8 MiB)", "`lease_initial` 30 s")
  with the field's default, and the same for the internal knobs of
  ``trio_pd._config.Tuning`` ("`poll_spin`, 100 us");
* the flags named in prose (`` `--grace` ``, `` `trio-pd serve --hosts 2` ``)
  with the argparse parsers: every flag exists (in that command, when the
  span names one), and a default stated next to it ("`--idle-timeout`
  (default 60") is the parser's.

The commands' flag tables, the config's fields, the metrics and the protocol's
messages are not checked here: they are rendered from the code when the docs
are built (``docs/_ext/pd_facts.py``); this test checks that no flag table is
typed by hand again.

A failure names the page, the line, the claim and what the code says.
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Iterator
from pathlib import Path

import attrs
import pytest

from trio_pd import ConnectorConfig
from trio_pd._cli import _parser
from trio_pd._config import Tuning
from trio_pd._core._protocol import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

Line = tuple[str, int, str]  # page, line number, text


def prose_lines(name: str, text: str) -> Iterator[Line]:
    """The lines of a page outside fenced blocks (code, directives, output)."""
    fence = ""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.lstrip()
        if fence:
            if stripped.startswith(fence) and not stripped[len(fence) :].strip():
                fence = ""
            continue
        opening = re.match(r"(`{3,}|~{3,})", stripped)
        if opening:
            fence = opening.group(1)
            continue
        yield name, number, line


def _problem(line: Line, claim: str, code: str) -> str:
    page, number, _ = line
    return f"{page}:{number}: {claim!r}, but the code says {code}"


# ---- the protocol version ---------------------------------------------------

VERSION_CLAIMS = [
    re.compile(r"describes protocol version \**(\d+)\**"),
    re.compile(r"`protocol_version` \((\d+)\)"),
    re.compile(r"`protocol_version` \| integer \| `(\d+)`"),
    re.compile(r"`protocol_version` is not (\d+)"),
    re.compile(r"`PROTOCOL_VERSION` is (\d+)"),
    # "speaks protocol version 4" and the like; history ("since protocol version
    # 3", "Version 2 added") is not a claim about the current version.
    re.compile(r"(?<!since )(?<!before )(?<!until )\bprotocol version \**(\d+)\**(?! requested)"),
]


def version_problems(lines: Iterator[Line]) -> list[str]:
    problems = []
    for line in lines:
        seen: set[int] = set()
        for pattern in VERSION_CLAIMS:
            for match in pattern.finditer(line[2]):
                if match.start(1) in seen:  # (one number, matched by two patterns)
                    continue
                seen.add(match.start(1))
                if int(match.group(1)) != PROTOCOL_VERSION:
                    problems.append(
                        _problem(line, match.group(0), f"PROTOCOL_VERSION = {PROTOCOL_VERSION}")
                    )
    return problems


# ---- ConnectorConfig defaults -----------------------------------------------

UNITS = {
    None: 1.0,
    "s": 1.0,
    "ms": 1e-3,
    "us": 1e-6,
    "µs": 1e-6,
    "%": 1e-2,
    "bytes": 1.0,
    "KiB": 2.0**10,
    "MiB": 2.0**20,
    "GiB": 2.0**30,
}
NUMBER = r"`?(\d+(?:\.\d+)?)`?(?:\s*(s|ms|us|µs|%|bytes|KiB|MiB|GiB)\b|\s*(%))?"


def config_defaults() -> dict[str, tuple[str, float]]:
    """Each numeric field of ``ConnectorConfig`` and of the internal knobs it
    carries (``Tuning``, which internals.md describes): its class and default."""
    defaults = {}
    for cls in (ConnectorConfig, Tuning):
        for field in attrs.fields(cls):
            value = field.default
            if isinstance(value, int | float) and not isinstance(value, bool):
                defaults[field.name] = (cls.__name__, float(value))
    return defaults


def config_claim(name: str) -> re.Pattern[str]:
    """ "`name` (default 5 s", "`name` (8 MiB)", "`name` 30 s", "`name`, 100 us"."""
    return re.compile(rf"`{name}`(?:\s*\(|,\s*|\s+)(?:default\s+)?{NUMBER}")


def config_problems(lines: Iterator[Line]) -> list[str]:
    claims = {name: config_claim(name) for name in config_defaults()}
    defaults = config_defaults()
    problems = []
    for line in lines:
        for name, pattern in claims.items():
            for match in pattern.finditer(line[2]):
                number, unit = float(match.group(1)), match.group(2) or match.group(3)
                stated = number * UNITS[unit]
                owner, default = defaults[name]
                if not math.isclose(stated, default, rel_tol=1e-9):
                    problems.append(_problem(line, match.group(0), f"{owner}.{name} = {default:g}"))
    return problems


# ---- the commands' flags -------------------------------------------------------
#
# The flag tables themselves are rendered from the parsers when the docs are
# built (``docs/_ext/pd_facts.py``, the ``cli-flags`` directive); what is left
# to check is the prose: the flags it names and the defaults it states.

# Flags in backticks that are not trio-pd's: argparse's own, and the soak
# benchmark's (``nox -s soak -- --seconds N``).
OTHER_FLAGS = {"--help", "--seconds"}


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    for action in _parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("trio-pd has no subcommands")


def documented_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every flag that ``--help`` shows, by its name."""
    return {
        option: action
        for action in parser._actions
        if action.help != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction)
        for option in action.option_strings
    }


def _default_matches(stated: str, action: argparse.Action) -> tuple[bool, str]:
    """Whether ``stated`` (a default in prose, backticks and unit removed) is the action's."""
    default = action.default
    shown = f"default {default!r}" + (", required" if action.required else "")
    if isinstance(default, bool):  # (a switch: "off" or "on")
        return stated == ("on" if default else "off"), shown
    if isinstance(default, int | float):
        try:
            return math.isclose(float(stated), float(default)), shown
        except ValueError:
            return False, shown
    return stated == str(default), shown


CODE_SPAN = re.compile(r"`([^`]+)`")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
# "`--grace` (default 10", "`--etcd-ttl`, default 10 s", "`--x` (default: `/p/`"
FLAG_DEFAULT = re.compile(r"`(--[a-z0-9-]+)[^`]*`,? \(?default:? `?([^`),; ]+)")
# "`trio-pd serve --grace 5`", "`nox -s demo -- --hosts 2`": the flags of one command
COMMAND_LINE = re.compile(r"^(?:trio-pd (\w+)|nox -s (demo) --)(?: |$)")


def flag_problems(lines: Iterator[Line]) -> list[str]:
    parsers = command_parsers()
    flags = {command: documented_flags(parser) for command, parser in parsers.items()}
    every_flag = set().union(*flags.values())
    problems = []
    for line in lines:
        for span in CODE_SPAN.finditer(line[2]):
            code = span.group(1)
            command_line = COMMAND_LINE.match(code)
            command = command_line and (command_line.group(1) or command_line.group(2))
            if command and command not in parsers:
                problems.append(_problem(line, code, f"trio-pd has no command {command}"))
                continue
            if not command and not code.startswith("-"):
                continue  # another program's command line (curl, a benchmark script)
            for flag in FLAG.findall(code):
                if flag in OTHER_FLAGS:
                    continue
                if command and flag not in flags[command]:
                    problems.append(_problem(line, code, f"trio-pd {command} has no {flag}"))
                elif flag not in every_flag:
                    problems.append(_problem(line, code, f"no trio-pd command has {flag}"))
        for claim in FLAG_DEFAULT.finditer(line[2]):
            flag, stated = claim.groups()
            having = [command for command, named in flags.items() if flag in named]
            checked = [_default_matches(stated, flags[command][flag]) for command in having]
            if having and not any(ok for ok, _ in checked):
                code = "; ".join(
                    f"trio-pd {c} {shown}" for c, (_, shown) in zip(having, checked, strict=True)
                )
                problems.append(_problem(line, claim.group(0), code))
    return problems


CLI_FLAGS_DIRECTIVE = re.compile(r"^```\{cli-flags\} (\w+)$", re.M)


# ---- the tests -----------------------------------------------------------------


def all_lines() -> list[Line]:
    return [
        line for page in PAGES for line in prose_lines(page.name, page.read_text(encoding="utf-8"))
    ]


@pytest.mark.parametrize("check", [version_problems, config_problems, flag_problems])
def test_the_docs_agree_with_the_code(check: object) -> None:
    assert callable(check)
    problems = check(iter(all_lines()))
    assert not problems, "\n".join(problems)


def test_the_checks_find_claims_on_the_pages() -> None:
    """Each pattern still matches the pages' wording (a check that matches
    nothing would pass forever)."""
    lines = all_lines()
    text = "\n".join(t for _, _, t in lines)
    # (the messages' tables of protocol.md render the version from the code)
    assert sum(len(p.findall(text)) for p in VERSION_CLAIMS) >= 6
    stated = {n for n in config_defaults() if config_claim(n).search(text)}
    assert {"handshake_timeout", "transfer_timeout", "close_timeout", "abort_timeout"} <= stated
    assert len(stated) >= 10, stated
    assert len(FLAG_DEFAULT.findall(text)) >= 5
    named = {flag for span in CODE_SPAN.findall(text) for flag in FLAG.findall(span)}
    assert len(named) >= 30, named


def test_every_command_has_its_flag_table_rendered_from_its_parser() -> None:
    """No flag table is typed by hand any more: each command's is the
    ``cli-flags`` directive, which renders the parser at build time."""
    sources = {page.name: page.read_text(encoding="utf-8") for page in PAGES}
    rendered = {c for text in sources.values() for c in CLI_FLAGS_DIRECTIVE.findall(text)}
    assert rendered == set(command_parsers()) - {"keygen"}
    hand_written = [
        f"{page}:{number}"
        for page, number, text in all_lines()
        if re.match(r"\|\s*flag\s*\|\s*default\s*\|", text)
    ]
    assert not hand_written, f"hand-written flag tables: {hand_written}"


def test_no_table_of_keys_or_errors_is_typed_by_hand() -> None:
    """The wire protocol's keys (messages, envelope, ``kv_transfer_params``)
    and the servers' error answers are rendered from the code
    (``docs/_ext/pd_facts_wire.py``): no page types such a table again."""
    hand_written = [
        f"{page}:{number}"
        for page, number, text in all_lines()
        if re.match(r"\|\s*(key|exception|status)\s*\|\s*(type|meaning|status|`type`)\s*\|", text)
    ]
    assert not hand_written, f"hand-written key or error tables: {hand_written}"
    text = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    assert "```{protocol-envelope}" in text
    assert "```{kv-transfer-params}" in text
    assert (ROOT / "docs" / "serving.md").read_text(encoding="utf-8").count("{error-statuses}") == 2


def planted(text: str) -> list[Line]:
    return list(prose_lines("planted.md", text))


def test_a_wrong_protocol_version_is_found() -> None:
    wrong = PROTOCOL_VERSION + 1
    problems = version_problems(
        iter(planted(f"This page describes protocol version **{wrong}**.\n"))
    )
    assert problems == [
        f"planted.md:1: 'describes protocol version **{wrong}**', "
        f"but the code says PROTOCOL_VERSION = {PROTOCOL_VERSION}"
    ]
    history = f"a list of entries, since protocol version {PROTOCOL_VERSION - 1}"
    assert version_problems(iter(planted(history))) == []
    fenced = f"```text\nprotocol version {wrong}\n```\n"
    assert version_problems(iter(planted(fenced))) == []


def test_a_wrong_config_default_is_found_whatever_the_phrasing() -> None:
    page = planted(
        "`handshake_timeout` (default 10 s) and `transfer_timeout` (30 s)\n"
        "`max_bytes_per_transfer` (4 MiB), `poll_spin`, 100 us, `lease_initial` 30 s\n"
        "`notification_poll_interval` (1 ms); `backoff_jitter` 20 % shorter\n"
        "the internal `inline_read_spin`, 1 ms\n"
    )
    problems = config_problems(iter(page))
    assert problems == [
        "planted.md:1: '`handshake_timeout` (default 10 s', "
        "but the code says ConnectorConfig.handshake_timeout = 5",
        "planted.md:2: '`max_bytes_per_transfer` (4 MiB', "
        "but the code says ConnectorConfig.max_bytes_per_transfer = 8.38861e+06",
        "planted.md:3: '`notification_poll_interval` (1 ms', "
        "but the code says ConnectorConfig.notification_poll_interval = 0.002",
        "planted.md:4: '`inline_read_spin`, 1 ms', "
        "but the code says Tuning.inline_read_spin = 0.0005",
    ]


def test_a_wrong_flag_default_and_unknown_flags_are_found() -> None:
    page = planted(
        "`--grace` (default 10) and `--connect-timeout` (default 6); `--etcd-ttl`, default 10 s\n"
        "run `trio-pd serve --idle-timeout 5` or `trio-pd proxy --idle-timeout 5`\n"
        "`--no-such-flag`, `trio-pd nope --grace 1`, `nox -s demo -- --hosts 2 --help`\n"
    )
    problems = flag_problems(iter(page))
    assert problems == [
        "planted.md:1: '`--connect-timeout` (default 6', "
        "but the code says trio-pd proxy default 2.0",
        "planted.md:2: 'trio-pd serve --idle-timeout 5', "
        "but the code says trio-pd serve has no --idle-timeout",
        "planted.md:3: '--no-such-flag', but the code says no trio-pd command has --no-such-flag",
        "planted.md:3: 'trio-pd nope --grace 1', but the code says trio-pd has no command nope",
    ]


REPO_PATH = re.compile(r"`((?:docs|src|tests|benchmarks|\.ci)/[\w./-]+)(?:::(\w+))?")


def test_every_repository_path_a_page_names_exists() -> None:
    """A file a page sends the reader to ("`docs/_ext/pd_budget.py`") is there
    (build outputs, ``docs/_build``, aside), and so is a test it names
    ("`tests/test_tokens.py::test_a_forged_token_is_refused`")."""
    problems = []
    for page in PAGES:
        for line in prose_lines(page.name, page.read_text()):
            for path, test in REPO_PATH.findall(line[2]):
                if path.startswith("docs/_build"):
                    continue
                file = ROOT / path.rstrip("/.")
                if not file.exists():
                    problems.append(_problem(line, path, "no such file or folder"))
                elif test and not re.search(rf"^(async )?def {test}\(", file.read_text(), re.M):
                    problems.append(_problem(line, f"{path}::{test}", "no such test"))
    assert not problems, "\n".join(problems)


def test_each_package_docstring_names_every_module_it_holds() -> None:
    """Each package's ``__init__`` docstring is its map: it says what each of
    its modules holds (the picture in docs/internals.md draws the packages; a
    newcomer looks here for the one home of a concept)."""
    import ast

    missing = []
    for init in sorted((ROOT / "src" / "trio_pd").rglob("__init__.py")):
        package = init.parent
        if package.name in ("testing", "_cli"):  # (their docstrings are user-facing)
            continue
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        for module in sorted(package.glob("*.py")):
            name = module.stem
            if name != "__init__" and f"``{name}``" not in doc and f"``{name} ``" not in doc:
                missing.append(f"{package.relative_to(ROOT)}: {name}")
        for sub in sorted(p for p in package.iterdir() if (p / "__init__.py").exists()):
            if f"``{sub.name}``" not in doc:
                missing.append(f"{package.relative_to(ROOT)}: {sub.name}/")
    assert not missing, f"package docstrings that do not name these modules: {missing}"


def test_every_notification_the_docs_draw_has_the_current_prefix() -> None:
    """A hand-drawn diagram (``docs/diagrams/*.dot``) or a page that spells a
    notification spells the prefix the code sends."""
    from trio_pd._core._protocol import NOTIFICATION_PREFIX

    prefix = NOTIFICATION_PREFIX.decode()
    files = [*PAGES, *sorted((ROOT / "docs" / "diagrams").glob("*.dot"))]
    spelled = [
        (path.name, found)
        for path in files
        for found in re.findall(r"trio_pd:\d+:", path.read_text(encoding="utf-8"))
    ]
    assert any(name == "first-pull.dot" for name, _ in spelled)
    assert [s for s in spelled if s[1] != prefix] == [], f"the code sends {prefix!r}"
