"""Write small offline Sphinx inventories for trio and the Python standard library.

intersphinx normally downloads ``objects.inv`` from the documentation it links
to. The machines that build these docs have no network, so this script writes
the inventories itself: one entry per name that the docs or the docstrings
reference, each pointing at its real anchor on the public site. ``conf.py``
runs it at build time; run it by hand to look at the result::

    python docs/make_trio_inventory.py /tmp/inv   # writes trio.inv, python.inv

A name missing here shows up as a nitpick warning, and ``nox -s docs`` (which
builds with ``-W -n``) fails: add the name to the table below.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sphinx.util.inventory import InventoryFile

TRIO_URL = "https://trio.readthedocs.io/en/stable/"
PYTHON_URL = "https://docs.python.org/3/"

# (page, object type, names): every name is documented on that page with the
# anchor Sphinx gives it, which is the full name itself.
TRIO: list[tuple[str, str, tuple[str, ...]]] = [
    ("reference-core", "module", ("trio",)),
    (
        "reference-core",
        "function",
        (
            "trio.run",
            "trio.open_nursery",
            "trio.move_on_after",
            "trio.move_on_at",
            "trio.fail_after",
            "trio.fail_at",
            "trio.sleep",
            "trio.sleep_until",
            "trio.current_time",
            "trio.open_memory_channel",
            "trio.to_thread.run_sync",
            "trio.to_thread.current_default_thread_limiter",
            "trio.from_thread.run",
            "trio.from_thread.run_sync",
            "trio.from_thread.check_cancelled",
        ),
    ),
    (
        "reference-core",
        "class",
        (
            "trio.Nursery",
            "trio.TaskStatus",
            "trio.CancelScope",
            "trio.Event",
            "trio.CapacityLimiter",
            "trio.Semaphore",
            "trio.Lock",
            "trio.MemorySendChannel",
            "trio.MemoryReceiveChannel",
        ),
    ),
    (
        "reference-core",
        "method",
        (
            "trio.Nursery.start",
            "trio.Nursery.start_soon",
            "trio.TaskStatus.started",
            "trio.CancelScope.cancel",
            "trio.Event.set",
            "trio.Event.wait",
        ),
    ),
    (
        "reference-core",
        "attribute",
        (
            "trio.Nursery.cancel_scope",
            "trio.CancelScope.shield",
            "trio.CancelScope.cancelled_caught",
            "trio.CancelScope.deadline",
        ),
    ),
    ("reference-core", "data", ("trio.TASK_STATUS_IGNORED",)),
    (
        "reference-core",
        "exception",
        (
            "trio.Cancelled",
            "trio.TooSlowError",
            "trio.WouldBlock",
            "trio.EndOfChannel",
            "trio.BusyResourceError",
            "trio.ClosedResourceError",
            "trio.BrokenResourceError",
        ),
    ),
    (
        "reference-lowlevel",
        "function",
        (
            "trio.lowlevel.wait_readable",
            "trio.lowlevel.wait_writable",
            "trio.lowlevel.notify_closing",
            "trio.lowlevel.checkpoint",
            "trio.lowlevel.checkpoint_if_cancelled",
            "trio.lowlevel.cancel_shielded_checkpoint",
            "trio.lowlevel.add_instrument",
        ),
    ),
    ("reference-lowlevel", "class", ("trio.lowlevel.FdStream", "trio.abc.Instrument")),
    ("reference-io", "function", ("trio.open_tcp_listeners", "trio.serve_listeners")),
    ("reference-io", "class", ("trio.SocketStream",)),
]

PYTHON: list[tuple[str, str, tuple[str, ...]]] = [
    ("library/functions", "class", ("int", "float", "bool")),
    ("library/stdtypes", "class", ("str", "bytes", "dict", "tuple", "list", "frozenset", "set")),
    ("library/constants", "data", ("None", "True", "False")),
    (
        "library/exceptions",
        "exception",
        (
            "BaseException",
            "Exception",
            "ExceptionGroup",
            "BaseExceptionGroup",
            "KeyError",
            "ValueError",
            "RuntimeError",
            "OSError",
        ),
    ),
    (
        "library/collections.abc",
        "class",
        (
            "collections.abc.Sequence",
            "collections.abc.Mapping",
            "collections.abc.Iterable",
            "collections.abc.AsyncIterator",
        ),
    ),
    ("library/contextlib", "function", ("contextlib.asynccontextmanager",)),
    ("library/enum", "class", ("enum.Enum",)),
    ("library/time", "function", ("time.monotonic",)),
    ("library/threading", "class", ("threading.Event",)),
    ("library/hashlib", "function", ("hashlib.sha256",)),
    ("library/secrets", "function", ("secrets.token_hex",)),
]


@dataclass
class _Domain:
    """The part of a Sphinx domain that ``InventoryFile.dump`` reads."""

    name: str
    objects: list[tuple[str, str, str, str, str, int]] = field(default_factory=list)

    def get_objects(self) -> Iterator[tuple[str, str, str, str, str, int]]:
        return iter(self.objects)


@dataclass
class _Domains:
    domains: list[_Domain]

    def sorted(self) -> Iterator[_Domain]:
        return iter(sorted(self.domains, key=lambda d: d.name))


@dataclass
class _Config:
    project: str
    version: str


@dataclass
class _Env:
    """Stands in for the build environment: a config and the domains' objects."""

    config: _Config
    domains: _Domains


class _Builder:
    @staticmethod
    def get_target_uri(docname: str) -> str:
        return f"{docname}.html"


def _objects(
    table: Iterable[tuple[str, str, tuple[str, ...]]],
) -> list[tuple[str, str, str, str, str, int]]:
    out = []
    for page, objtype, names in table:
        for name in names:
            anchor = f"module-{name}" if objtype == "module" else name
            # (name, display name, type, page, anchor, priority): priority 1 is
            # what Sphinx gives ordinary objects (0 for modules).
            out.append((name, name, objtype, page, anchor, 0 if objtype == "module" else 1))
    return out


def write_inventory(
    path: Path, project: str, version: str, table: Iterable[tuple[str, str, tuple[str, ...]]]
) -> Path:
    """Write ``table`` as a version-2 ``objects.inv`` at ``path``; return ``path``."""
    env = _Env(_Config(project, version), _Domains([_Domain("py", _objects(table))]))
    path.parent.mkdir(parents=True, exist_ok=True)
    InventoryFile.dump(path, env, _Builder())  # type: ignore[arg-type]
    return path


def write_inventories(directory: Path) -> dict[str, tuple[str, str]]:
    """Write ``trio.inv`` and ``python.inv`` into ``directory``.

    Returns:
        the ``intersphinx_mapping`` that uses them.
    """
    trio_inv = write_inventory(directory / "trio.inv", "Trio", "stable", TRIO)
    python_inv = write_inventory(directory / "python.inv", "Python", "3", PYTHON)
    return {"trio": (TRIO_URL, str(trio_inv)), "python": (PYTHON_URL, str(python_inv))}


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    for name, (url, inv) in write_inventories(target).items():
        print(f"{name}: {inv} -> {url}")
