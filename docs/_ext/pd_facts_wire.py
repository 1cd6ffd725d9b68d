"""Sphinx extension: the wire protocol's tables and the servers' error answers,
rendered from trio_pd's code (with :mod:`pd_facts`' tables: nothing typed by
hand, and what cannot be rendered is an error, which fails the ``-W`` build).

Directives (for MyST pages):

``protocol-message`` *STRUCT*
    The keys of one side-channel message (a msgspec Struct of
    ``trio_pd._core._protocol``): key, wire type, meaning (its docstring).
``protocol-envelope``
    The two keys every side-channel message has (``_protocol._Envelope``):
    ``type``, with the tag of every message of ``trio_pd._core._protocol``, and
    ``protocol_version``. A message without ``protocol_version``, or one the
    envelope's ``type`` cannot name, is an error.
``kv-transfer-params``
    The ``kv_transfer_params`` keys (``_public_values.KV_TRANSFER_PARAMS``): key,
    JSON type (optional, with what absence means, when the
    :class:`~trio_pd.RemoteBlocks` attribute it carries has a default), and
    the attribute's description.
``error-statuses`` *engine* | *proxy*
    How the engine or the proxy answers each exception it catches, from
    ``trio_pd._serve.errors.ERROR_STATUSES``: exception, status, the error
    body's ``type``, when (with ``param``, ``Retry-After`` and the metric it
    is counted in). A row with no meaning, or for no server, is an error.
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
import msgspec
from pd_facts import Cell, Code, FactTable, Markdown, attribute_docs, rst_to_myst
from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer

import trio_pd._core._protocol as protocol
import trio_pd._core._public_values as records
import trio_pd._serve.errors as serve_errors
from trio_pd import RemoteBlocks

# ---- the wire protocol ---------------------------------------------------------------------


def wire_type(annotation: Any) -> str:
    """How a field's type travels in MessagePack, in words."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        inner, *meta = typing.get_args(annotation)
        text = wire_type(inner)
        for m in meta:
            if isinstance(m, msgspec.Meta) and m.ge is not None:
                text += f" ≥ {m.ge}"
        return text
    if origin is typing.Literal:
        values = [f'`"{v}"`' for v in typing.get_args(annotation)]
        return "string: " + ", ".join(values[:-1]) + " or " + values[-1]
    if origin is list:
        (item,) = typing.get_args(annotation)
        items = wire_type(item)
        return "array of " + ("maps" if items == "map" else items.replace("integer", "integers"))
    if isinstance(annotation, type) and issubclass(annotation, msgspec.Struct):
        return "map"
    names = {str: "string", int: "integer", bytes: "binary", bool: "boolean", float: "float"}
    if annotation in names:
        return names[annotation]
    raise ValueError(f"no wire type for {annotation!r}")


def message_rows(struct: type[msgspec.Struct]) -> list[tuple[str, str, str]]:
    """(key, type, meaning) of each key of a message, in wire order.

    Raises:
        ValueError: a field whose meaning is not documented in the code.
    """
    docs = ModuleAnalyzer.for_module(struct.__module__).find_attr_docs()
    hints = typing.get_type_hints(struct, include_extras=True, localns=vars(protocol))
    info = msgspec.structs.fields(struct)
    rows = []
    tag = struct.__struct_config__.tag
    if isinstance(tag, str):
        rows.append((struct.__struct_config__.tag_field or "type", "string", f'`"{tag}"`'))
    for field in info:
        lines = docs.get((struct.__name__, field.name))
        if field.name == "protocol_version":
            said = f" ({rst_to_myst(' '.join(' '.join(lines).split()))})" if lines else ""
            rows.append((field.name, "integer", f"`{protocol.PROTOCOL_VERSION}`{said}"))
            continue
        if not lines:
            raise ValueError(f"{struct.__name__}.{field.name} has no docstring in the code")
        meaning = rst_to_myst(" ".join(" ".join(lines).split()))
        kind = wire_type(hints[field.name])
        if field.default is not msgspec.NODEFAULT or field.default_factory is not msgspec.NODEFAULT:
            default = (
                field.default if field.default is not msgspec.NODEFAULT else field.default_factory()
            )
            kind += ", optional"
            meaning += f" Default `{msgspec.json.encode(default).decode()}`."
        rows.append((field.name, kind, meaning))
    return rows


class ProtocolMessage(FactTable):
    required_arguments = 1
    widths = (3, 3, 8)
    modules = (protocol,)

    def header(self) -> Sequence[str]:
        return ("key", "type", "meaning")

    def rows(self) -> Iterable[Sequence[Cell]]:
        struct = getattr(protocol, self.arguments[0], None)
        if not (isinstance(struct, type) and issubclass(struct, msgspec.Struct)):
            raise self.error(f"trio_pd._core._protocol has no message {self.arguments[0]!r}")
        try:
            rows = message_rows(struct)
        except ValueError as exc:
            raise self.error(str(exc)) from None
        for key, kind, meaning in rows:
            yield Code(key), Markdown(kind), Markdown(meaning)


def tagged_messages() -> list[type[msgspec.Struct]]:
    """The messages of ``trio_pd._core._protocol`` (the Structs with a tag), in its order."""
    return [
        value
        for value in vars(protocol).values()
        if isinstance(value, type)
        and issubclass(value, msgspec.Struct)
        and isinstance(value.__struct_config__.tag, str)
    ]


def envelope_rows() -> list[tuple[str, str, str]]:
    """(key, type, meaning) of the envelope every message has.

    Raises:
        ValueError: a message lacks an envelope key (or tags itself under
            another key than ``type``), or an envelope key is undocumented.
    """
    envelope = protocol._Envelope
    docs = ModuleAnalyzer.for_module(protocol.__name__).find_attr_docs()
    hints = typing.get_type_hints(envelope)
    messages = tagged_messages()
    rows = []
    for field in msgspec.structs.fields(envelope):
        lines = docs.get((envelope.__name__, field.name))
        if not lines:
            raise ValueError(f"_Envelope.{field.name} has no docstring in the code")
        meaning = rst_to_myst(" ".join(" ".join(lines).split()))
        for message in messages:
            config = message.__struct_config__
            if field.name not in (config.tag_field, *message.__struct_fields__):
                raise ValueError(f"{message.__name__} has no {field.name!r}: not an envelope")
        if field.name == "type":
            tags = [f'`"{m.__struct_config__.tag}"`' for m in messages]
            meaning = meaning.rstrip(".") + ": " + ", ".join(tags[:-1]) + " or " + tags[-1]
        elif field.name == "protocol_version":
            meaning = f"`{protocol.PROTOCOL_VERSION}` for the messages on this page. {meaning}"
        rows.append((field.name, wire_type(hints[field.name]), meaning))
    return rows


class ProtocolEnvelope(FactTable):
    widths = (3, 3, 8)
    modules = (protocol,)

    def header(self) -> Sequence[str]:
        return ("key", "type", "meaning")

    def rows(self) -> Iterable[Sequence[Cell]]:
        try:
            rows = envelope_rows()
        except ValueError as exc:
            raise self.error(str(exc)) from None
        for key, kind, meaning in rows:
            yield Code(key), Markdown(kind), Markdown(meaning)


# ---- kv_transfer_params -------------------------------------------------------------------

_JSON_TYPES = {str: "string", int: "integer"}


def kv_param_rows() -> list[tuple[str, str, str]]:
    """(key, JSON type, meaning) of each ``kv_transfer_params`` key, in order.

    Raises:
        ValueError: a key carries no attribute of :class:`~trio_pd.RemoteBlocks`,
            an attribute travels under no key, or it has no description.
    """
    fields = attrs.fields_dict(RemoteBlocks)
    docs = attribute_docs(RemoteBlocks)
    hints = typing.get_type_hints(RemoteBlocks)
    carried = set(records.KV_TRANSFER_PARAMS.values())
    if carried != set(fields):
        raise ValueError(
            f"KV_TRANSFER_PARAMS carries {sorted(carried)}, RemoteBlocks has {sorted(fields)}"
        )
    rows = []
    for key, name in records.KV_TRANSFER_PARAMS.items():
        if name not in docs:
            raise ValueError(f"RemoteBlocks.{name} has no entry in the docstring")
        hint = hints[name]
        if typing.get_origin(hint) is tuple:
            kind = "array of " + _JSON_TYPES[typing.get_args(hint)[0]] + "s"
        else:
            kind = _JSON_TYPES[hint]
        default = fields[name].default
        if default is not attrs.NOTHING:
            kind += f", optional (absent or null: `{msgspec.json.encode(default).decode()}`)"
        rows.append((key, kind, rst_to_myst(docs[name])))
    return rows


class KvTransferParams(FactTable):
    widths = (3, 3, 8)
    modules = (records,)

    def header(self) -> Sequence[str]:
        return ("key", "type", "meaning")

    def rows(self) -> Iterable[Sequence[Cell]]:
        try:
            rows = kv_param_rows()
        except ValueError as exc:
            raise self.error(str(exc)) from None
        for key, kind, meaning in rows:
            yield Code(key), Markdown(kind), Markdown(meaning)


# ---- exceptions -> HTTP statuses ----------------------------------------------------------


def exception_name(cls: type) -> str:
    """``cls`` as a reader imports it: ``trio_pd.HandshakeError``, ``httpx2.ConnectError``
    (from the top-level package when it exports it), else module and name."""
    if cls.__module__ == "builtins":
        return cls.__qualname__
    package = cls.__module__.split(".")[0]
    if getattr(sys.modules.get(package), cls.__name__, None) is cls:
        return f"{package}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


@attrs.frozen
class ErrorRow:
    exceptions: tuple[str, ...]
    status: str
    type: str  # Markdown
    meaning: str  # Markdown


def error_status_rows(where: str) -> list[ErrorRow]:
    """The rows of ``ERROR_STATUSES`` that ``where`` (engine or proxy) answers,
    exceptions that share a row on one line, in the table's order.

    Raises:
        ValueError: a row with no meaning, or for a server that is neither.
    """
    grouped: dict[int, tuple[serve_errors.ErrorStatus, list[str]]] = {}
    for cls, row in serve_errors.ERROR_STATUSES.items():
        if not row.meaning.strip():
            raise ValueError(f"ERROR_STATUSES[{cls.__name__}] has no meaning")
        if not row.where or not set(row.where) <= {"engine", "proxy"}:
            raise ValueError(f"ERROR_STATUSES[{cls.__name__}]: where={row.where!r}")
        if where in row.where:
            grouped.setdefault(id(row), (row, []))[1].append(exception_name(cls))
    rows = []
    for row, names in grouped.values():
        status = str(row.status)
        if row.retry_after is not None:
            status += f", Retry-After: {row.retry_after}"
        if row.type == "{cls}":
            kind = "the exception's class name"
        elif "{role}" in row.type:
            kind = " or ".join(f"`{row.type.format(role=r)}`" for r in ("prefill", "decode"))
        else:
            kind = f"`{row.type}`"
        meaning = rst_to_myst(row.meaning)
        if row.param is not None:
            meaning += f" `param`: `{row.param.replace('{exc.field}', '<key>')}`."
        if row.counted is not None:
            meaning += f' Counted in `trio_pd_proxy_engine_errors_total` as `kind="{row.counted}"`.'
        rows.append(ErrorRow(tuple(names), status, kind, meaning))
    return rows


class ErrorStatuses(FactTable):
    required_arguments = 1
    widths = (4, 2, 3, 8)
    modules = (serve_errors,)

    def header(self) -> Sequence[str]:
        return ("exception", "status", Markdown("`type`"), "when")

    def rows(self) -> Iterable[Sequence[Cell]]:
        if self.arguments[0] not in ("engine", "proxy"):
            raise self.error(f"no errors of {self.arguments[0]!r} (engine or proxy)")
        try:
            rows = error_status_rows(self.arguments[0])
        except ValueError as exc:
            raise self.error(str(exc)) from None
        for row in rows:
            names = Markdown(", ".join(f"`{name}`" for name in row.exceptions))
            yield names, row.status, Markdown(row.type), Markdown(row.meaning)


def setup(app: Sphinx) -> dict[str, Any]:
    app.setup_extension("pd_facts")
    app.add_directive("protocol-message", ProtocolMessage)
    app.add_directive("protocol-envelope", ProtocolEnvelope)
    app.add_directive("kv-transfer-params", KvTransferParams)
    app.add_directive("error-statuses", ErrorStatuses)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
