"""The tree is the map: which package may import which, checked on the code.

The graph is the one ``docs/internals.md`` draws (``docs/_ext/pd_packages.py``
parses every module with :mod:`ast`; lazy imports inside functions count).
Each package's ``__init__`` docstring states the same rule as
:data:`MAY_IMPORT`; a new import across packages either fits it or changes
both, on purpose.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

import pd_packages  # noqa: E402
from pd_packages import BASE, FACADE, SRC, imported_modules  # noqa: E402

LIBRARY = {"_core", BASE, "_side_channel", "_transfer", "_transfer._nixl", "_consumer", "_producer"}
MAY_IMPORT: dict[str, set[str]] = {
    "_core": set(),
    BASE: {"_core"},
    "_side_channel": {"_core", BASE},
    "_transfer": {"_core", BASE},
    "_transfer._nixl": {"_core", BASE, "_transfer"},
    "_consumer": {"_core", BASE, "_side_channel", "_transfer"},
    "_producer": {"_core", BASE, "_side_channel", "_transfer"},
    "_membership": {"_core", BASE},
    FACADE: LIBRARY - {FACADE},
    "_serve": {"_core", BASE, "_side_channel", "_membership", FACADE},
    "_harness": LIBRARY | {FACADE, "_serve"},
    "_cli": LIBRARY | {FACADE, "_serve", "_membership", "_harness"},
    "testing": LIBRARY | {FACADE, "_serve", "_membership", "_harness"},
}
"""Package -> the packages it may import. Read bottom-up: the sans-IO core,
the shells (side channel, transfer), the roles, the facade, then what runs
around the library (serving, the harness, the CLI, ``trio_pd.testing``)."""


def test_every_package_imports_only_what_its_layer_allows() -> None:
    graph = pd_packages.package_imports()
    assert set(graph) == set(MAY_IMPORT), "a package was added or removed: place it here"
    offenders = [
        f"{package} imports {there}: {sorted(why)}"
        for package, imports in graph.items()
        for there, why in imports.items()
        if there not in MAY_IMPORT[package]
    ]
    assert not offenders, offenders


def test_the_graph_has_no_cycle_between_packages() -> None:
    graph = pd_packages.package_imports()
    done: set[str] = set()

    def visit(package: str, path: tuple[str, ...]) -> None:
        assert package not in path, " -> ".join((*path, package))
        if package not in done:
            for there in graph.get(package, {}):
                visit(there, (*path, package))
            done.add(package)

    for package in graph:
        visit(package, ())


def test_the_check_sees_a_lazy_import_that_points_upward() -> None:
    """The check is not vacuous: a lazy import inside a function of the core,
    relative or absolute, is an edge."""
    planted = (
        "def f():\n    from .._consumer._pulls import Consumer\n    import trio_pd._serve.proxy\n"
    )
    found = {m for _, m in imported_modules(planted, "trio_pd._core")}
    assert {"trio_pd._consumer._pulls", "trio_pd._serve.proxy"} <= found
    assert pd_packages.package_of("trio_pd._consumer._pulls") == "_consumer"
    assert pd_packages.package_of("trio_pd._transfer._nixl._driver") == "_transfer._nixl"
    assert pd_packages.package_of("trio_pd._config") == BASE
    assert pd_packages.package_of("trio_pd._connector") == FACADE


def test_no_module_outside_the_testing_toolkit_imports_it() -> None:
    """Production code (every module of ``src/trio_pd`` but ``trio_pd.testing``'s
    own: the commands, ``trio-pd demo`` included, and what they run in child
    processes) never imports ``trio_pd.testing``, even lazily inside a function."""
    offenders = []
    for path in sorted((SRC / "trio_pd").rglob("*.py")):
        if (SRC / "trio_pd" / "testing") in path.parents:
            continue
        package = ".".join(path.relative_to(SRC).parts[:-1])
        for line, module in imported_modules(path.read_text(), package):
            if module == "trio_pd.testing" or module.startswith("trio_pd.testing."):
                offenders.append(f"{path.relative_to(SRC)}:{line}: {module}")
    assert not offenders, offenders


def test_the_import_check_sees_every_way_of_importing_the_toolkit() -> None:
    """The check above is not vacuous: absolute, relative and lazy imports and a
    module name handed to a child process are all found."""
    planted = (
        "import trio_pd.testing\n"
        "from .. import testing\n"
        "def f():\n"
        "    from ..testing._memory import MemoryFabric\n"
        "    return open_child('trio_pd.testing._registered_engine', '')\n"
    )
    found = {m for _, m in imported_modules(planted, "trio_pd._cli")}
    assert found == {
        "trio_pd",
        "trio_pd.testing",
        "trio_pd.testing._memory",
        "trio_pd.testing._memory.MemoryFabric",
        "trio_pd.testing._registered_engine",
    }, found


def test_the_sans_io_core_imports_no_io_library() -> None:
    """``trio_pd._core`` (the protocol, state machines and decisions) stays free
    of ZeroMQ, NIXL, sockets and threads: the shells around it are the other
    packages (trio for the types of public records, torch for tensor types)."""
    offenders = []
    for path in sorted((SRC / "trio_pd" / "_core").rglob("*.py")):
        package = ".".join(path.relative_to(SRC).parts[:-1])
        for line, module in imported_modules(path.read_text(), package):
            top = module.split(".")[0]
            inside = module.startswith("trio_pd._core") or module == "trio_pd"
            if top in ("zmq", "nixl", "socket", "threading", "httpx2") or (
                top == "trio_pd" and not inside
            ):
                offenders.append(f"{path.relative_to(SRC)}:{line}: {module}")
    assert not offenders, offenders
