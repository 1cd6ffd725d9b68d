"""Every flag of ``trio-pd``'s commands says what it does in ``--help``.

No process is started: the argparse parser is built and read.
"""

from __future__ import annotations

import argparse

import pytest

from trio_pd._cli import _parser

COMMANDS = ("demo", "serve", "engine", "proxy")


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """Each subcommand's parser, by name."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("trio-pd has no subcommands")


def flags_without_help(parser: argparse.ArgumentParser) -> list[str]:
    """The flags whose ``--help`` line says nothing (hidden ones, ``SUPPRESS``, are fine)."""
    return [
        "/".join(action.option_strings)
        for action in parser._actions
        if action.option_strings
        and not isinstance(action, argparse._HelpAction)
        and not (action.help and action.help.strip())
    ]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_flag_has_a_help_string(command: str) -> None:
    parser = subcommands(_parser())[command]
    missing = flags_without_help(parser)
    assert not missing, f"trio-pd {command}: flags without help: {', '.join(missing)}"


def test_the_check_finds_a_flag_without_help() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--said", help="what it does")
    parser.add_argument("--hidden", help=argparse.SUPPRESS)
    parser.add_argument("--silent")
    parser.add_argument("--blank", help=" ")
    assert flags_without_help(parser) == ["--silent", "--blank"]


def test_every_command_is_checked() -> None:
    names = set(subcommands(_parser()))
    assert set(COMMANDS) <= names
    # keygen has no flags of its own; any other new command must be listed above
    assert names - set(COMMANDS) == {"keygen"}
    assert flags_without_help(subcommands(_parser())["keygen"]) == []


def test_demo_help_shows_every_default() -> None:
    """``trio-pd demo --help`` is where the README sends you "for sizes"."""
    parser = subcommands(_parser())["demo"]
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.option_strings and not isinstance(action, argparse._HelpAction):
            assert f"(default: {action.default})" in text, action.option_strings[0]
