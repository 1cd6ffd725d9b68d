"""``python -m trio_pd.exercises``: check your code for a write-the-code exercise.

The *Write it* exercises of the documentation (docs/exercises.md) are files
``docs/exercises/write_NAME.py`` with a ``TODO`` that you fill in. Run as a
program, each file hands your code to its checker
(``docs/exercises/checkers/``), which says what is still wrong ("not yet:
...") and exits 0 only when nothing is. This command runs that check by name::

    python -m trio_pd.exercises list
    python -m trio_pd.exercises check deadline      # docs/exercises/write_deadline.py
    python -m trio_pd.exercises check deadline --solution

The exercises are found in ``docs/exercises`` under the current directory
(run it from the root of a checkout), or under ``--path DIR``. Its exit
status: 0 solved, 1 not yet (or your code raised), 2 no such exercise.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

DEFAULT_PATH = Path("docs") / "exercises"
PREFIX = "write_"

SOLVED, NOT_YET, NOT_FOUND = 0, 1, 2


def exercise_names(path: Path) -> list[str]:
    """The write-the-code exercises in ``path``: ``write_NAME.py`` gives ``NAME``."""
    return sorted(p.stem.removeprefix(PREFIX) for p in path.glob(f"{PREFIX}*.py"))


def exercise_file(path: Path, name: str, *, solution: bool = False) -> Path:
    """The file of exercise ``name`` (``deadline``, ``write_deadline`` or
    ``write_deadline.py``), or of its solution."""
    stem = PREFIX + name.removesuffix(".py").removeprefix(PREFIX)
    return (path / "solutions" if solution else path) / f"{stem}.py"


def check(path: Path, name: str, *, solution: bool = False) -> int:
    """Run exercise ``name``'s file (or its solution) with its checker, in this
    process; its exit status (:data:`SOLVED`, :data:`NOT_YET` or :data:`NOT_FOUND`)."""
    if not path.is_dir():
        print(
            f"no folder {path}: run this from the root of a trio_pd checkout, "
            "or pass --path DIR (the folder of the exercises)",
            file=sys.stderr,
        )
        return NOT_FOUND
    file = exercise_file(path, name, solution=solution)
    if not file.is_file():
        names = ", ".join(exercise_names(path)) or "none"
        print(f"no exercise {name!r}: no file {file} (exercises here: {names})", file=sys.stderr)
        return NOT_FOUND
    try:
        runpy.run_path(str(file), run_name="__main__")
    except SystemExit as exc:  # the checker's verdict (sys.exit), or the code's own exit
        status = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
        return SOLVED if status == 0 else NOT_YET
    except Exception as exc:  # a bug in the code under check: say where
        traceback.print_exc()
        print(f"not yet: your code raised {type(exc).__name__}: {exc}")
        return NOT_YET
    return SOLVED  # the checker returned: it found nothing wrong


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trio_pd.exercises",
        description=(
            "Check your code for a write-the-code exercise of docs/exercises.md: the "
            "file docs/exercises/write_NAME.py, run with its checker. Exit status: 0 "
            "solved, 1 not yet, 2 no such exercise."
        ),
    )
    parser.add_argument(
        "--path",
        type=Path,
        default=DEFAULT_PATH,
        help=(
            "the folder of the exercises (default: docs/exercises under the current "
            "directory, i.e. run from the root of a checkout)"
        ),
    )
    commands = parser.add_subparsers(dest="command", required=True)
    checking = commands.add_parser("check", help="run an exercise's checker on your code")
    checking.add_argument("name", help="the exercise: NAME of write_NAME.py (e.g. deadline)")
    checking.add_argument(
        "--solution",
        action="store_true",
        help="check the solution (docs/exercises/solutions/write_NAME.py) instead",
    )
    commands.add_parser("list", help="list the write-the-code exercises")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns its exit status."""
    args = _parser().parse_args(argv)
    if args.command == "list":
        for name in exercise_names(args.path):
            print(f"{name}: {exercise_file(args.path, name)}")
        return SOLVED
    return check(args.path, args.name, solution=args.solution)


if __name__ == "__main__":
    sys.exit(main())
