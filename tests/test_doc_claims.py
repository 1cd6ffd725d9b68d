"""The numbers and names the docs copy from the code still agree with it.

A fast check (no build, no process): it reads ``docs/*.md`` and ``README.md``
and compares, wherever a page states one,

* the side-channel protocol version with ``_protocol.PROTOCOL_VERSION``;
* a ``ConnectorConfig`` default stated next to its field name ("`handshake_timeout`
  (default 5 s)", "`max_bytes_per_transfer` (8 MiB)", "`lease_initial` 30 s",
  "`poll_spin`, 100 us") with the field's default;
* the ``| flag | default | what |`` tables of the commands (under a
  "`trio-pd COMMAND`" heading) with the argparse parser: every flag named
  exists, its default is the parser's, and every flag the command has is in
  its table.

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
from trio_pd._protocol import PROTOCOL_VERSION

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


def config_defaults() -> dict[str, float]:
    """Each numeric field of ``ConnectorConfig`` and its default."""
    defaults = {}
    for field in attrs.fields(ConnectorConfig):
        value = field.default
        if isinstance(value, int | float) and not isinstance(value, bool):
            defaults[field.name] = float(value)
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
                if not math.isclose(stated, defaults[name], rel_tol=1e-9):
                    problems.append(
                        _problem(
                            line, match.group(0), f"ConnectorConfig.{name} = {defaults[name]:g}"
                        )
                    )
    return problems


# ---- the commands' flag tables ----------------------------------------------


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


def _cells(row: str) -> list[str]:
    """A table row's cells (``\\|`` inside a cell is a literal bar)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", row.strip().strip("|"))]


def flag_tables(lines: Iterator[Line]) -> Iterator[tuple[str, Line, list[str]]]:
    """(command, line, [flag cell, default cell]) for each row of each flag table."""
    command, in_table = "", False
    for line in lines:
        text = line[2]
        heading = re.match(r"#+ .*`trio-pd (\w+)`", text)
        if heading:
            command = heading.group(1)
        if not text.startswith("|"):
            in_table = False
            continue
        cells = _cells(text)
        if cells[:2] == ["flag", "default"]:
            in_table = True
            if not command:
                raise AssertionError(f"{line[0]}:{line[1]}: a flag table under no command heading")
            continue
        if in_table and not set("".join(cells)) <= set("-| :"):
            yield command, line, cells


def _default_matches(stated: str, action: argparse.Action) -> tuple[bool, str]:
    """Whether ``stated`` (a table's default, backticks removed) is the action's default."""
    default = action.default
    shown = f"default {default!r}" + (", required" if action.required else "")
    if stated == "(required)":
        return action.required, shown
    if stated == "none":
        return not default and not action.required, shown
    if isinstance(default, bool):  # (a switch: "off" or "on")
        return stated == ("on" if default else "off"), shown
    if isinstance(default, int | float):
        try:
            if math.isclose(float(stated), float(default)):
                return True, shown
        except ValueError:
            pass
    elif stated == str(default):
        return True, shown
    if not default:
        # A default derived from elsewhere ("--host", "2048, or what the pool
        # holds", "$TRIO_PD_EXPOSURE_SECRET"): the flag's help must say it.
        said = re.search(r"default:? ([^,;)]+)", action.help or "")
        derived = said is not None and said.group(1).strip() == stated
        return derived, f"{shown}, help {action.help!r}"
    return False, shown


def flag_problems(lines: Iterator[Line]) -> list[str]:
    parsers = command_parsers()
    problems = []
    documented: dict[str, set[str]] = {}
    for command, line, cells in flag_tables(lines):
        if command not in parsers:
            problems.append(_problem(line, f"trio-pd {command}", "there is no such command"))
            continue
        flags = documented_flags(parsers[command])
        named = re.findall(r"`(--[a-z0-9-]+)", cells[0])
        documented.setdefault(command, set()).update(named)
        # "none, `/trio_pd/`, 10" for three flags; one value for all otherwise.
        # For one flag, what follows ", or" or ";" qualifies the value.
        values = [v.strip() for v in cells[1].split(", ")] if len(named) > 1 else [cells[1]]
        if len(values) != len(named):
            values = values[:1] * len(named)
        for flag, value in zip(named, values, strict=True):
            if flag not in flags:
                problems.append(_problem(line, flag, f"trio-pd {command} has no {flag}"))
                continue
            stated = re.split(r", or |; ", value)[0].replace("`", "").strip()
            ok, code = _default_matches(stated, flags[flag])
            if not ok:
                problems.append(_problem(line, f"{flag}: {value}", f"trio-pd {command} {code}"))
    for command, in_table in documented.items():
        missing = sorted(set(documented_flags(parsers[command])) - in_table - {"-h", "--help"})
        if missing:
            problems.append(f"the flag table of trio-pd {command} lacks {', '.join(missing)}")
    return problems


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
    assert sum(len(p.findall(text)) for p in VERSION_CLAIMS) >= 8
    stated = {n for n in config_defaults() if config_claim(n).search(text)}
    assert {"handshake_timeout", "transfer_timeout", "close_timeout", "abort_timeout"} <= stated
    assert len(stated) >= 10, stated
    commands = {command for command, _, _ in flag_tables(iter(lines))}
    assert commands == {"engine", "proxy", "serve"}


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
        "`notification_poll_interval` (2 ms); `backoff_jitter` 20 % shorter\n"
    )
    problems = config_problems(iter(page))
    assert problems == [
        "planted.md:1: '`handshake_timeout` (default 10 s', "
        "but the code says ConnectorConfig.handshake_timeout = 5",
        "planted.md:2: '`max_bytes_per_transfer` (4 MiB', "
        "but the code says ConnectorConfig.max_bytes_per_transfer = 8.38861e+06",
        "planted.md:3: '`notification_poll_interval` (2 ms', "
        "but the code says ConnectorConfig.notification_poll_interval = 0.001",
    ]


def test_a_wrong_flag_default_an_unknown_flag_and_a_missing_one_are_found() -> None:
    rows = "\n".join(
        f"| `{flag}` | {default} | ... |"
        for flag, default in documented_defaults_of_proxy().items()
        if flag != "--idle-timeout"
    )
    page = planted(
        "### `trio-pd proxy`\n\n| flag | default | what |\n|---|---|---|\n"
        + rows.replace("| `--port` | 8000 |", "| `--port` | 8080 |")
        + "\n| `--no-such-flag` | 1 | ... |\n"
    )
    problems = flag_problems(iter(page))
    assert len(problems) == 3, problems
    assert "'--port: 8080', but the code says trio-pd proxy default 8000" in problems[0]
    assert "trio-pd proxy has no --no-such-flag" in problems[1]
    assert problems[2] == "the flag table of trio-pd proxy lacks --idle-timeout"


def documented_defaults_of_proxy() -> dict[str, str]:
    """A correct table of ``trio-pd proxy``'s flags, made from the parser."""
    table = {}
    for flag, action in documented_flags(command_parsers()["proxy"]).items():
        if flag.startswith("--"):
            default = action.default
            table[flag] = "none" if not default else str(default)
    return table
