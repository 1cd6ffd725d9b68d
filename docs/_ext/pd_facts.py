"""Sphinx extension: tables of facts that trio_pd's code defines, rendered from it.

Nothing in these tables is typed by hand, so a change in the code changes the
page; what cannot be rendered (a setting with no docstring, a docstring whose
"Default X" disagrees with the code, a protocol field with no description)
is an error, which fails the ``-W`` build.

Directives (for MyST pages: the descriptions are parsed as Markdown):

``cli-flags`` *COMMAND*
    ``trio-pd COMMAND``'s flags from its argparse parser (``trio_pd._cli``,
    built, not run): flag, default, and the ``--help`` text.
``config-fields`` [*Tuning*]
    Every public field of :class:`trio_pd.ConnectorConfig` (or, with the
    argument ``Tuning``, every internal knob of ``trio_pd._config.Tuning``):
    its default (from attrs) and its description (the docstring's
    ``Attributes:`` entry).
``prometheus-metrics`` *engine* | *proxy*
    The metrics an engine or the proxy exports at ``/metrics``: name as
    exposed, type, labels, help (for the connector's statistics, the
    :class:`trio_pd.ConnectorStatistics` field's description).
``exit-statuses`` *COMMAND* ...
    The exit statuses of the ``trio-pd`` commands named, one column each, from
    ``trio_pd._cli.common.EXIT_STATUSES``; a command of the parser with no entry
    there, an entry for no command, or a status other than ``EXIT_OK``,
    ``EXIT_FAILED`` and ``EXIT_USAGE`` is an error.
``loggers``
    Every logger of :data:`trio_pd._loggers.LOGGERS` and what it logs; a
    ``logging.getLogger`` in the sources that names a logger not listed there,
    or a listed logger that no code uses, is an error (``pd_loggers`` reads
    the sources).

The wire protocol's tables and the servers' error answers are rendered by
``pd_facts_wire``, with this module's tables.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import math
import re
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import attrs
from docutils import nodes
from docutils.statemachine import StringList
from pd_loggers import unlisted_or_unused
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

import trio_pd._cli as cli
import trio_pd._cli.common as cli_common
import trio_pd._cli.demo as cli_demo
import trio_pd._cli.engine as cli_engine
import trio_pd._cli.proxy as cli_proxy
import trio_pd._cli.serve as cli_serve
import trio_pd._config as config
import trio_pd._core._public_values as records
import trio_pd._loggers as loggers
import trio_pd._serve.engine as serve_engine
import trio_pd._serve.metrics as serve_metrics
import trio_pd._serve.proxy as serve_proxy
from trio_pd import ConnectorConfig, ConnectorStatistics

# ---- docstrings ----------------------------------------------------------------


def attribute_docs(cls: type) -> dict[str, str]:
    """The entries of a Google-style ``Attributes:`` section, each on one line."""
    doc = inspect.getdoc(cls) or ""
    entries: dict[str, str] = {}
    in_section, name = False, ""
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            in_section = True
            continue
        if not in_section:
            continue
        if line and not line.startswith(" "):  # the next section
            break
        entry = re.match(r"    (\w+)(?:, (\w+))*: (.*)", line)
        if entry:
            name = entry.group(1)
            entries[name] = entry.group(3)
        elif name and line.strip():
            entries[name] += " " + line.strip()
    return entries


def rst_to_myst(text: str) -> str:
    """Inline reST of a docstring as MyST: ``x`` and :role:`target`."""
    text = re.sub(r":(\w+(?::\w+)?):`([^`]+)`", r"{\1}`\2`", text)
    return re.sub(r"``([^`]+)``", r"`\1`", text)


# ---- tables ----------------------------------------------------------------------


class Markdown(str):
    """A cell parsed as MyST Markdown (a plain ``str`` is text; ``Code``, a literal)."""


class Code(str):
    """A cell shown as one literal."""


Cell = str


class FactTable(SphinxDirective):
    """A directive that renders a table; subclasses give the header and rows."""

    has_content = False
    required_arguments = 0
    option_spec: ClassVar[dict[str, Any]] = {}
    widths: ClassVar[Sequence[int]] = ()
    modules: ClassVar[Sequence[types.ModuleType]] = ()

    def header(self) -> Sequence[str]:
        raise NotImplementedError

    def rows(self) -> Iterable[Sequence[Cell]]:
        raise NotImplementedError

    def run(self) -> list[nodes.Node]:
        if not type(self.state).__module__.startswith("myst_parser"):
            raise self.error(f"{self.name}: for MyST pages only (its cells are Markdown)")
        for module in self.modules:  # rebuild the page when the code changes
            self.env.note_dependency(inspect.getsourcefile(module) or "")
        header = self.header()
        table = nodes.table(classes=["pd-facts", self.name])
        group = nodes.tgroup(cols=len(header))
        table += group
        for width in self.widths or [1] * len(header):
            group += nodes.colspec(colwidth=width)
        head = nodes.thead()
        group += head
        head += self._row(header)
        body = nodes.tbody()
        group += body
        for row in self.rows():
            body += self._row(row)
        return [table]

    def _row(self, cells: Sequence[Cell]) -> nodes.row:
        row = nodes.row()
        for cell in cells:
            entry = nodes.entry()
            if isinstance(cell, Markdown):
                self.state.nested_parse(StringList([str(cell)]), self.content_offset, entry)
            elif isinstance(cell, Code):
                entry += nodes.paragraph("", "", nodes.literal(cell, cell))
            else:  # as the code says it: "--host" stays two hyphens
                entry += nodes.paragraph("", "", nodes.Text(cell), support_smartquotes=False)
            row += entry
        return row


# ---- the commands' flags ---------------------------------------------------------


def command_parsers() -> dict[str, argparse.ArgumentParser]:
    """Each ``trio-pd`` command's parser, built (nothing runs)."""
    for action in cli._parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("trio-pd has no subcommands")


def flag_rows(parser: argparse.ArgumentParser) -> list[tuple[str, str, str]]:
    """(flag as typed, default, help) of each flag ``--help`` shows."""
    formatter = parser._get_formatter()
    rows = []
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._HelpAction):
            continue
        rows.append(_default_and_help(action, formatter._expand_help(action)))
    return rows


_SAID_DEFAULT = re.compile(r" ?\(default:? ([^()]*(?:\([^()]*\)[^()]*)*)\)|^default: (.*)$")


def _default_and_help(action: argparse.Action, help_text: str) -> tuple[str, str, str]:
    """(flag, default, help): a default the help states ("(default: --host)", for a
    flag whose parser default is empty or 0) goes into the default column."""
    flag = ", ".join(action.option_strings)
    if action.nargs != 0:
        if action.choices:
            metavar = "|".join(str(c) for c in action.choices)
        else:
            metavar = str(action.metavar or action.dest.upper())
        flag += f" {metavar}" + (" ..." if action.nargs == "+" else "")
    default = action.default
    said = _SAID_DEFAULT.search(help_text)
    if action.required:
        shown = "(required)"
    elif isinstance(default, bool):
        shown = "on" if default else "off"
    elif said and (not default or _same(said.group(1) or said.group(2), default)):
        shown = said.group(1) or said.group(2)
        help_text = (help_text[: said.start()] + help_text[said.end() :]).strip()
    elif default in ("", None, []):
        shown = "none"
    elif isinstance(default, float):
        shown = f"{default:g}"
    else:
        shown = str(default)
    return flag, shown, help_text


def _same(stated: str, default: object) -> bool:
    try:
        return math.isclose(float(stated), float(default))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


class CliFlags(FactTable):
    required_arguments = 1
    widths = (3, 2, 7)
    modules = (cli, cli_common, cli_demo, cli_engine, cli_proxy, cli_serve)

    def header(self) -> Sequence[str]:
        return ("flag", "default", "what")

    def rows(self) -> Iterable[Sequence[Cell]]:
        command = self.arguments[0]
        parsers = command_parsers()
        if command not in parsers:
            raise self.error(f"trio-pd has no command {command!r} ({', '.join(parsers)})")
        for flag, default, what in flag_rows(parsers[command]):
            yield Code(flag), Code(default) if default != "none" else default, what


# ---- ConnectorConfig -----------------------------------------------------------------

_UNITS = {"": 1, "KiB": 1 << 10, "MiB": 1 << 20}
_STATED_DEFAULT = re.compile(
    r"\s*Default (?P<value>``[^`]*``|[\w.]+?)(?: (?P<unit>KiB|MiB))?(?: \([^)]*\))?\.\s*$"
)


def config_rows(cls: type = ConnectorConfig) -> list[tuple[str, str, str]]:
    """(field, default, description) of every public field of ``cls`` (an attrs
    class; ``ConnectorConfig``'s private ``_tuning`` is :class:`Tuning`'s table).

    Raises:
        ValueError: a field with no description, or whose description states
            a default that is not the field's.
    """
    docs = attribute_docs(cls)
    rows = []
    for field in attrs.fields(cls):
        if field.name.startswith("_"):
            continue
        if field.name not in docs:
            raise ValueError(f"{cls.__name__}.{field.name} has no entry in the docstring")
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        what = docs[field.name]
        stated = _STATED_DEFAULT.search(what)
        if stated:
            value, unit = stated.group("value"), stated.group("unit") or ""
            _check_stated(f"{cls.__name__}.{field.name}", value, unit, default)
            what = what[: stated.start()]
        rows.append((field.name, _shown(default), what))
    return rows


def _check_stated(name: str, value: str, unit: str, default: object) -> None:
    if value.startswith("``"):
        ok = ast.literal_eval(value.strip("`")) == default
    elif isinstance(default, bool) or value in ("True", "False"):
        ok = value == str(default)
    else:
        try:
            ok = math.isclose(float(value) * _UNITS[unit], float(default))  # type: ignore[arg-type]
        except (TypeError, ValueError):
            ok = False
    if not ok:
        raise ValueError(
            f"{name}: the docstring says 'Default {value}{unit and ' '}{unit}', "
            f"the code {default!r}"
        )


def _shown(default: object) -> str:
    mib = 1 << 20
    if isinstance(default, int) and not isinstance(default, bool) and default >= mib:
        return f"{default >> 20} MiB" if default % mib == 0 else repr(default)
    if isinstance(default, types.MappingProxyType):
        default = dict(default)
    return repr(default)


class ConfigFields(FactTable):
    optional_arguments = 1
    widths = (3, 2, 8)
    modules = (config,)
    RECORDS: ClassVar[dict[str, type]] = {
        "ConnectorConfig": ConnectorConfig,
        "Tuning": config.Tuning,
    }

    def header(self) -> Sequence[str]:
        return ("field", "default", "what")

    def rows(self) -> Iterable[Sequence[Cell]]:
        name = self.arguments[0] if self.arguments else "ConnectorConfig"
        if name not in self.RECORDS:
            raise self.error(f"no config record {name!r} ({', '.join(self.RECORDS)})")
        try:
            rows = config_rows(self.RECORDS[name])
        except ValueError as exc:
            raise self.error(str(exc)) from None
        for name, default, what in rows:
            yield Code(name), Code(default), Markdown(rst_to_myst(what))


# ---- Prometheus metrics ------------------------------------------------------------------


@attrs.frozen
class MetricRow:
    name: str  # as exposed: a counter's ends in _total
    type: str
    labels: tuple[str, ...]
    help: str


def _wrapper_rows(metrics: object) -> list[MetricRow]:
    """The ``prometheus_client`` metrics that are attributes of ``metrics``."""
    from prometheus_client.metrics import MetricWrapperBase

    rows = []
    for value in vars(metrics).values():
        if isinstance(value, MetricWrapperBase):
            (family,) = value.describe()
            suffix = "_total" if family.type == "counter" else ""
            labels = tuple(getattr(value, "_labelnames", ()))
            rows.append(MetricRow(family.name + suffix, family.type, labels, family.documentation))
    return rows


def engine_metric_rows() -> list[MetricRow]:
    """An engine's metrics: its own, then its connectors' statistics."""
    metrics = serve_engine.EngineMetrics(lambda: 0, list)
    rows = _wrapper_rows(metrics)
    # The free-blocks gauge is a local of EngineMetrics: read it off the registry.
    listed = {row.name for row in rows}
    for family in metrics.registry.collect():
        if family.name not in listed and family.name + "_total" not in listed:
            rows.append(MetricRow(family.name, family.type, (), family.documentation))
    stats = attribute_docs(ConnectorStatistics)
    for family in metrics.connectors.describe():
        field = family.name.removeprefix("trio_pd_")
        suffix = "_total" if family.type == "counter" else ""
        labels = ("cause",) if field == serve_metrics.BY_CAUSE else ()
        what = stats.get(field)
        if what is None:
            raise ValueError(f"ConnectorStatistics.{field} has no entry in the docstring")
        rows.append(MetricRow(family.name + suffix, family.type, labels, what))
    return rows


def proxy_metric_rows() -> list[MetricRow]:
    return _wrapper_rows(serve_metrics.ProxyMetrics())


class PrometheusMetrics(FactTable):
    required_arguments = 1
    widths = (4, 1, 2, 7)
    modules = (serve_engine, serve_metrics, serve_proxy, records)
    SOURCES: ClassVar[dict[str, Callable[[], list[MetricRow]]]] = {
        "engine": engine_metric_rows,
        "proxy": proxy_metric_rows,
    }

    def header(self) -> Sequence[str]:
        return ("metric", "type", "labels", "what")

    def rows(self) -> Iterable[Sequence[Cell]]:
        source = self.SOURCES.get(self.arguments[0])
        if source is None:
            raise self.error(f"no metrics of {self.arguments[0]!r} (engine or proxy)")
        try:
            rows = source()
        except ValueError as exc:
            raise self.error(str(exc)) from None
        for row in rows:
            labels = ", ".join(row.labels)
            yield (
                Code(row.name),
                row.type,
                Code(labels) if labels else "",
                Markdown(rst_to_myst(row.help)),
            )


# ---- exit statuses ----------------------------------------------------------------------------


def exit_status_rows(commands: Sequence[str]) -> list[tuple[int, list[str]]]:
    """(status, what it means for each of ``commands``) for every status any of
    them exits with ("" where one never does).

    Raises:
        ValueError: ``EXIT_STATUSES`` and the parser's commands differ, or a
            status is not one of the ``EXIT_*`` constants.
    """
    table = cli_common.EXIT_STATUSES
    parsed = set(command_parsers())
    if set(table) != parsed:
        raise ValueError(
            f"trio_pd._cli.common.EXIT_STATUSES has {sorted(table)}, "
            f"the parser's commands are {sorted(parsed)}"
        )
    known = {cli_common.EXIT_OK, cli_common.EXIT_FAILED, cli_common.EXIT_USAGE}
    for command, statuses in table.items():
        if not set(statuses) <= known:
            raise ValueError(f"EXIT_STATUSES[{command!r}]: {sorted(statuses)} (not EXIT_*)")
    for command in commands:
        if command not in table:
            raise ValueError(f"trio-pd has no command {command!r} ({', '.join(table)})")
    used = sorted({status for command in commands for status in table[command]})
    return [(status, [table[c].get(status, "") for c in commands]) for status in used]


class ExitStatuses(FactTable):
    required_arguments = 1
    optional_arguments = 8
    modules = (cli, cli_common)

    def header(self) -> Sequence[str]:
        return ("status", *(Markdown(f"`{command}`") for command in self.arguments))

    def rows(self) -> Iterable[Sequence[Cell]]:
        try:
            rows = exit_status_rows(self.arguments)
        except ValueError as exc:
            raise self.error(str(exc)) from None
        for status, whats in rows:
            yield (str(status), *(Markdown(rst_to_myst(w)) if w else "" for w in whats))


# ---- loggers ---------------------------------------------------------------------------------


def logger_rows() -> list[tuple[str, str]]:
    """(logger, what it logs) of every logger trio_pd uses.

    Raises:
        ValueError: the sources use a logger that is not listed, or a listed
            logger is used nowhere.
    """
    problems = unlisted_or_unused()
    if problems:
        raise ValueError("; ".join(problems))
    return list(loggers.LOGGERS.items())


class Loggers(FactTable):
    widths = (2, 8)
    modules = (loggers,)

    def header(self) -> Sequence[str]:
        return ("logger", "what")

    def rows(self) -> Iterable[Sequence[Cell]]:
        try:
            rows = logger_rows()
        except ValueError as exc:
            raise self.error(str(exc)) from None
        for name, what in rows:
            yield Code(name), Markdown(rst_to_myst(what))


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("cli-flags", CliFlags)
    app.add_directive("config-fields", ConfigFields)
    app.add_directive("prometheus-metrics", PrometheusMetrics)
    app.add_directive("exit-statuses", ExitStatuses)
    app.add_directive("loggers", Loggers)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
