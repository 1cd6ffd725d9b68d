"""The docs point at tests that exist, so they cannot drift silently."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = re.compile(r"`(tests/[\w/]+\.py)(?:::(\w+))?`")


def _test_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test")
    }


def test_every_test_named_in_the_failure_table_exists() -> None:
    text = (ROOT / "docs" / "failure-semantics.md").read_text()
    references = REFERENCE.findall(text)
    assert len(references) >= 25
    for file, name in references:
        path = ROOT / file
        assert path.is_file(), file
        if name:
            assert name in _test_names(path), f"{file}::{name}"
