"""Sessions: ``tests`` (the CI gate), ``lint``, ``typecheck``, ``demo``, ``docs``, ``bench``,
``soak`` (10 minutes across test hosts, as root), ``cluster`` (the long
cluster scenario across test hosts, as root) and ``chaos`` (long random runs
of the chaos state machine); the last three are not run by default.

``chaos`` runs the partial-failure state machine of ``tests/test_chaos.py`` for
long (the ``tests`` session runs a short, fixed-seed version of it): random
cases, ``TRIO_PD_CHAOS_EXAMPLES`` of them (default 100) of
``TRIO_PD_CHAOS_STEPS`` steps (default 60), each printing its seed;
``TRIO_PD_CHAOS_SEED=<seed>`` replays a run (as closely as a real clock allows),
``TRIO_PD_CHAOS_VERBOSE=1`` prints every step and a summary per case, and
``TRIO_PD_CHAOS_KNOWN_BUGS=1`` lets it walk into the bugs pinned there as
xfail tests (by default it steers around them to look for new ones).

torch is installed first, pinned to the CPU build that these machines keep
on local disk (about 35 s instead of a multi-GB CUDA download); on a GPU host
the same code runs with CUDA tensors.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"
# pytest-xdist's scheduling for the tests session: tests dealt out one by one,
# in order ("load" sends chunks of a quarter of a worker's share otherwise), so
# no worker is left with a long tail of its own; the test-host tests come first
# and all go to one worker (tests/conftest.py). Three workers on 2 cores: a
# third of the suite's time is waiting (for engine processes, leases, sockets),
# and with two workers the cores were busy 64% of it (measured: 340 s of CPU in
# 266 s); a third worker fills that (same load: 252 s with two, 209 s with three)
WORKERS = ["-n", "3", "--dist", "load", "--maxschedchunk", "1"]
# startable functions (task_status=...), for flake8-async's ASYNC113/114
STARTABLE = ",".join(
    [
        "serve_listener",
        "_read_replies",
        "run_one",
        "run_engine",
        "serve_delay_relay",
        "serve_zap",
        "_serve_replies",
        "_keep_watching",
        "serve_proxy",
        "hold_registration",
        "watch_engines",
        "serve_prefill_channel",
        "hostile",
        "_held",
        "open_one",
        "run_slot",
        "serve",
        "serve_auth",
        "_follow_peers",
        "serve_first",
    ]
)


def install_project(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    target = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", target)


def install_debian_tools(session: nox.Session, *, graphviz: bool, etcd: bool) -> None:
    """Debian packages the sessions need, installed (one apt run) only if missing:
    Graphviz's ``dot`` draws the docs' diagrams; ``etcd-server`` is the real etcd
    that the membership tests run."""
    wanted = []
    if graphviz and shutil.which("dot") is None:
        wanted.append("graphviz")
    if etcd and shutil.which("etcd") is None and not os.access("/usr/bin/etcd", os.X_OK):
        wanted.append("etcd-server")
    if not wanted:
        return
    sudo = ["sudo"] if os.geteuid() != 0 and shutil.which("sudo") else []
    session.run(*sudo, "apt-get", "update", external=True)
    session.run(*sudo, "apt-get", "install", "-y", *wanted, external=True)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite: real NIXL agents, real ZeroMQ sockets, real processes, real etcd.

    On 2 pytest-xdist workers (``-- -n 0`` for one process); the tests marked
    ``test_hosts`` take turns through a lock (``tests/conftest.py``).
    """
    # tests/test_docs.py builds the docs; tests/test_membership.py runs etcd
    install_debian_tools(session, graphviz=True, etcd=True)
    install_project(session, "test")
    session.run("pytest", *WORKERS, *session.posargs, env={"NIXL_LOG_LEVEL": "WARN"})


@nox.session
def lint(session: nox.Session) -> None:
    """ruff (lint + format) and flake8-async."""
    session.install("ruff>=0.8", "flake8-async>=24.9")
    session.run("ruff", "check", "src", "tests", "benchmarks", "noxfile.py")
    session.run("ruff", "format", "--check", "src", "tests", "benchmarks", "noxfile.py")
    tops = ("src", "tests", "benchmarks")
    files = sorted(str(p) for top in tops for p in Path(top).rglob("*.py"))
    session.run("flake8-async", f"--startable-in-context-manager={STARTABLE}", *files)


@nox.session
def typecheck(session: nox.Session) -> None:
    """mypy --strict on src/."""
    install_project(session)
    session.install("mypy>=1.11", "pytest>=8")  # pytest: trio_pd.testing.fixtures
    session.run("mypy")


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark suite; rewrites docs/performance.md and docs/performance.json."""
    install_project(session)
    session.run(
        "python",
        "benchmarks/pd_bench.py",
        "--json",
        "docs/performance.json",
        "--markdown",
        "docs/performance.md",
        *session.posargs,
        env={"NIXL_LOG_LEVEL": "WARN", "PYTHONPATH": "benchmarks"},
    )


@nox.session
def cluster(session: nox.Session) -> None:
    """The long cluster scenario across test hosts (root, about 30 s): engines on
    three hosts found through etcd, riding out an etcd restart, a new engine, a
    partitioned decode host and a killed one (``tests/test_cluster.py``); kept
    out of ``tests`` for the suite's time."""
    install_debian_tools(session, graphviz=False, etcd=True)
    install_project(session, "test")
    session.run("pytest", "-m", "cluster", *session.posargs, env={"NIXL_LOG_LEVEL": "WARN"})


@nox.session
def soak(session: nox.Session) -> None:
    """A 600 s soak across test hosts (root) under faults; rewrites its docs section.

    Real engines on test hosts while producers are killed, links cut and
    forged requests sent; every must-be-zero count must be 0. Rewrites the
    soak's section of docs/performance.md and docs/soak.json.
    ``nox -s soak -- --seconds 60`` for a shorter run, ``--seed S`` to repeat one.
    First the soak's own short test (``pytest -m soak``), then the soak.
    """
    install_project(session, "test")
    session.run("pytest", "-m", "soak", "tests/test_soak.py", env={"NIXL_LOG_LEVEL": "WARN"})
    session.run(
        "python",
        "benchmarks/soak.py",
        "--json",
        "docs/soak.json",
        "--markdown",
        "docs/performance.md",
        *session.posargs,
        env={"NIXL_LOG_LEVEL": "WARN", "PYTHONPATH": "benchmarks"},
    )


@nox.session
def chaos(session: nox.Session) -> None:
    """The chaos state machine, long and random (see the module docstring)."""
    install_project(session, "test")
    env = {
        "NIXL_LOG_LEVEL": "WARN",
        "TRIO_PD_CHAOS_EXAMPLES": os.environ.get("TRIO_PD_CHAOS_EXAMPLES", "100"),
        "TRIO_PD_CHAOS_STEPS": os.environ.get("TRIO_PD_CHAOS_STEPS", "60"),
    }
    session.run("pytest", "-s", "tests/test_chaos.py::test_chaos", *session.posargs, env=env)


@nox.session
def demo(session: nox.Session) -> None:
    """The main job: a small verified P/D deployment (``trio-pd demo``)."""
    install_project(session)
    session.run("trio-pd", "demo", *session.posargs)


@nox.session
def docs(session: nox.Session) -> None:
    """The documentation as HTML in docs/_build/html; every warning is an error."""
    install_debian_tools(session, graphviz=True, etcd=False)
    install_project(session, "docs")
    session.run(
        "sphinx-build",
        "-W",
        "--keep-going",
        "-n",
        "-b",
        "html",
        "docs",
        "docs/_build/html",
        *session.posargs,
        env={"NIXL_LOG_LEVEL": "WARN"},
    )
