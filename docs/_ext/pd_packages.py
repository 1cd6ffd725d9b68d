"""Sphinx extension: the picture of trio_pd's packages and their imports, read from the code.

Every module of ``src/trio_pd`` is parsed (with :mod:`ast`, nothing is
imported); each import of another trio_pd module, lazy ones inside functions
included, becomes an edge between the two modules' packages. The picture is
drawn when the docs are built, so it cannot drift from the code;
``tests/test_layers.py`` checks the same graph against the rules each
package's docstring states.

Directive:

``.. package-import-diagram::``
    The packages (with their modules) and which imports which, as a
    Graphviz graph rendered by ``sphinx.ext.graphviz``.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[2] / "src"
TESTING_MODULE = re.compile(r"trio_pd\.testing(\.\w+)*")
FACADE = "trio_pd"
"""The picture's name for the public surface: ``__init__`` and ``_connector``
(``__main__`` is drawn with ``_cli``, which it runs)."""
BASE = "(top level)"
"""The picture's name for the other top-level modules, which every layer may import:
``_config``, ``_curve_keys``, ``_exception_groups``, ``_loggers``."""
FACADE_MODULES = frozenset({"trio_pd", "trio_pd._connector"})


def imported_modules(text: str, package: str) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in ``text``, a module of ``package``
    (relative imports resolved; ``from m import n`` gives ``m`` and ``m.n``),
    and of every string that is a ``trio_pd.testing`` module name (a module a
    child process is told to run)."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = ".".join(parts[: len(parts) - node.level + 1]) if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and TESTING_MODULE.fullmatch(node.value)
        ):
            found.append((node.lineno, node.value))
    return found


def modules() -> dict[str, Path]:
    """Every module of trio_pd by dotted name (packages by their ``__init__``)."""
    found = {}
    for path in sorted((SRC / "trio_pd").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def package_of(module: str) -> str:
    """The package a trio_pd module belongs to in the picture: ``_core``,
    ``_transfer._nixl``..., :data:`FACADE` or :data:`BASE`."""
    if module in FACADE_MODULES:
        return FACADE
    if module == "trio_pd.__main__":
        return "_cli"
    parts = module.split(".")[1:]
    if not (SRC / "trio_pd" / parts[0]).is_dir():
        return BASE
    if parts[0] == "_transfer" and len(parts) > 1 and parts[1] == "_nixl":
        return "_transfer._nixl"
    return parts[0]


def package_imports() -> dict[str, dict[str, set[str]]]:
    """``{package: {imported package: {"module -> module", ...}}}``: every
    import between two packages, with the modules that make it."""
    known = modules()
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for name, path in known.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        here = package_of(name)
        graph[here]  # (a package that imports nothing is still drawn)
        for _, module in imported_modules(path.read_text(), package):
            if not module.startswith("trio_pd"):
                continue
            while module not in known and "." in module:
                module = module.rpartition(".")[0]  # (from m import name)
            there = package_of(module)
            if there != here:
                graph[here][there].add(f"{name} -> {module}")
    return {k: dict(v) for k, v in graph.items()}


def package_members() -> dict[str, list[str]]:
    """The modules of each package, by their short names."""
    members: dict[str, list[str]] = defaultdict(list)
    for name in modules():
        package = package_of(name)
        short = name.removeprefix("trio_pd.").removeprefix(package).lstrip(".")
        if name == "trio_pd.__main__":
            short = "trio_pd.__main__"
        if package in (FACADE, BASE):
            short = name.removeprefix("trio_pd.") if name != "trio_pd" else "__init__"
        if short:
            members[package].append(short)
    return dict(members)


def package_dot() -> str:
    """Graphviz source: one box per package listing its modules, one arrow per
    imported package (labelled with how many module imports make it; the
    arrows into ``_core`` and the top-level modules, which every layer
    imports, are drawn faint)."""
    members = package_members()
    lines = [
        "digraph packages {",
        '  rankdir=BT; node [shape=box, fontname="monospace", fontsize=10];',
        '  edge [color="#555555", fontsize=9];',
    ]
    for package, imports in sorted(package_imports().items()):
        names = sorted(members.get(package, []))
        rows = [", ".join(names[i : i + 3]) for i in range(0, len(names), 3)]
        title = package if package in (FACADE, BASE) else package.replace(".", "/") + "/"
        label = "\\n".join([title, *rows])
        lines.append(f'  "{package}" [label="{label}"];')
        for there, why in sorted(imports.items()):
            faint = ', color="#bbbbbb", fontcolor="#999999"' if there in ("_core", BASE) else ""
            lines.append(f'  "{package}" -> "{there}" [label="{len(why)}"{faint}];')
    lines.append("}")
    return "\n".join(lines)


def setup(app: Any) -> dict[str, Any]:
    from docutils import nodes
    from docutils.statemachine import StringList
    from sphinx.ext.graphviz import Graphviz

    class PackageImportDiagram(Graphviz):
        """``sphinx.ext.graphviz``'s directive, fed with :func:`package_dot`."""

        has_content = False
        required_arguments = 0
        optional_arguments = 0

        def run(self) -> list[nodes.Node]:
            for path in modules().values():
                self.env.note_dependency(str(path))
            self.arguments = []
            self.content = StringList(package_dot().splitlines(), source="src/trio_pd")
            self.options.setdefault("alt", "trio_pd's packages and which imports which")
            self.options.setdefault("align", "center")
            return super().run()

    app.add_directive("package-import-diagram", PackageImportDiagram)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
