"""Sessions: ``tests`` (the CI gate), ``lint``, ``typecheck``, ``demo``.

torch is installed first, pinned to the CPU build that these machines keep
on local disk (about 35 s instead of a multi-GB CUDA download); on a GPU host
the same code runs with CUDA tensors.
"""

from __future__ import annotations

from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
STARTABLE = "_serve_listener,_read_replies,run_one,serve_delay_relay,serve_zap,_serve_replies"


def install_project(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    target = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", target)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite: real NIXL agents, real ZeroMQ sockets, real processes."""
    install_project(session, "test")
    session.run("pytest", *session.posargs, env={"NIXL_LOG_LEVEL": "WARN"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint + format) and flake8-async."""
    session.install("ruff>=0.8", "flake8-async>=24.9")
    session.run("ruff", "check", "src", "tests", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "noxfile.py")
    files = sorted(str(p) for top in ("src", "tests") for p in Path(top).rglob("*.py"))
    session.run("flake8-async", f"--startable-in-context-manager={STARTABLE}", *files)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on src/."""
    install_project(session)
    session.install("mypy>=1.11")
    session.run("mypy")


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: a small verified P/D deployment (``trio-pd demo``)."""
    install_project(session)
    session.run("trio-pd", "demo", *session.posargs)
