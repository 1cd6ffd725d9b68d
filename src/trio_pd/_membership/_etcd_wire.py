"""etcd's v3 JSON gateway, sans I/O: request bodies in, parsed answers out.

etcd serves its gRPC API as JSON over HTTP (``POST /v3/kv/range`` and so on;
etcd 3.4 also answers under the deprecated ``/v3beta/``). On the wire:

* keys and values are base64 strings;
* 64-bit integers (revisions, lease ids, TTLs) are decimal *strings*, and a
  field whose value is zero (or false, or empty) is left out;
* a watch is a long ``POST /v3/watch`` whose answer is one JSON object per
  line, each ``{"result": WatchResponse}`` or ``{"error": {...}}``; an event
  of type PUT has no ``type`` (PUT is enum value 0), a DELETE has
  ``"type": "DELETE"``;
* an error answer is ``{"error": ..., "message": ..., "code": GRPC_CODE}``
  with an HTTP status derived from the gRPC code.

Nothing here does I/O (see :mod:`trio_pd._membership._etcd_client`); every parser raises
:class:`MembershipError` with cause ``"bad_response"`` on what it cannot read.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from typing import Any, Literal

import attrs

from trio_pd._core._errors import TrioPdError

# gRPC status codes that etcd answers with and that callers act on
NOT_FOUND = 5  # "etcdserver: requested lease not found"

Cause = Literal["unreachable", "timeout", "disconnected", "rejected", "bad_response", "conflict"]


class MembershipError(TrioPdError):
    """etcd could not be used: every failure of the membership client is one of these.

    Attributes:
        endpoint: the etcd URL (and path) that failed.
        cause: ``"unreachable"`` (no connection), ``"timeout"`` (no answer
            in time), ``"disconnected"`` (the connection broke, or a watch
            stream ended, mid-answer), ``"rejected"`` (etcd answered with
            an error), ``"bad_response"`` (an answer that is not etcd's), or
            ``"conflict"`` (an engine id that a live engine holds).
        detail: a one-line description (etcd's own message when it sent one).
        code: the gRPC status code etcd answered with (``"rejected"`` only).
    """

    def __init__(self, endpoint: str, cause: Cause, detail: str, code: int | None = None):
        super().__init__(f"etcd at {endpoint}: {cause}: {detail}")
        self.endpoint = endpoint
        self.cause: Cause = cause
        self.detail = detail
        self.code = code

    def __reduce__(self) -> tuple[type[MembershipError], tuple[str, Cause, str, int | None]]:
        return (type(self), (self.endpoint, self.cause, self.detail, self.code))


# ---- encoding ---------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that, with ``key=prefix``, selects every key starting with it.

    The prefix with its last byte below 0xff incremented (trailing 0xff
    bytes dropped), as etcd's clients compute it; ``b"\\0"`` (every key from
    ``prefix`` on) when there is no such byte.
    """
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def grant_body(ttl: int) -> dict[str, Any]:
    return {"TTL": ttl}


def lease_body(lease: int) -> dict[str, Any]:
    """``/v3/lease/keepalive`` and ``/v3/lease/revoke``."""
    return {"ID": str(lease)}


def put_body(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        body["lease"] = str(lease)
    return body


def delete_body(key: bytes) -> dict[str, Any]:
    return {"key": b64(key)}


def claim_body(key: bytes, value: bytes, lease: int, mod_revision: int) -> dict[str, Any]:
    """A transaction that puts ``key`` only if it is still as seen: absent
    (``mod_revision`` 0) or last modified at ``mod_revision``; else reads it."""
    compare: dict[str, Any] = {"key": b64(key), "result": "EQUAL"}
    if mod_revision:
        compare.update(target="MOD", mod_revision=str(mod_revision))
    else:
        compare.update(target="CREATE", create_revision="0")
    return {
        "compare": [compare],
        "success": [{"request_put": put_body(key, value, lease)}],
        "failure": [{"request_range": {"key": b64(key)}}],
    }


def prefix_range_body(prefix: bytes, *, count_only: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(prefix), "range_end": b64(prefix_range_end(prefix))}
    if count_only:
        body["count_only"] = True
    return body


def watch_body(prefix: bytes, start_revision: int) -> dict[str, Any]:
    """Watch every key under ``prefix`` from ``start_revision`` on (with their previous
    values left out: a DELETE names only the key)."""
    return {
        "create_request": {
            "key": b64(prefix),
            "range_end": b64(prefix_range_end(prefix)),
            "start_revision": str(start_revision),
        }
    }


# ---- decoding ---------------------------------------------------------------


@attrs.frozen
class KeyValue:
    """One key as etcd reports it (``value`` is empty for a deleted key)."""

    key: bytes
    value: bytes = b""
    mod_revision: int = 0
    lease: int = 0


@attrs.frozen
class WatchEvent:
    kind: Literal["put", "delete"]
    kv: KeyValue


@attrs.frozen
class WatchMessage:
    """One line of a watch stream.

    ``created``: the watch now runs. ``canceled``: etcd ended it; when
    ``compact_revision`` is set, because the start revision was compacted
    away (read everything again and watch from the new revision).
    ``revision``: the store's revision when the message was sent.
    """

    revision: int
    events: tuple[WatchEvent, ...] = ()
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""


@attrs.frozen
class Lease:
    id: int
    ttl: int  # seconds; 0 (keepalive) means the lease no longer exists


def _bad(endpoint: str, detail: str) -> MembershipError:
    return MembershipError(endpoint, "bad_response", detail)


def _int(endpoint: str, obj: Mapping[str, Any], name: str) -> int:
    value = obj.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise _bad(endpoint, f"{name} is {value!r}, not an integer")
    try:
        return int(value)
    except ValueError:
        raise _bad(endpoint, f"{name} is {value!r}, not an integer") from None


def _bytes(endpoint: str, obj: Mapping[str, Any], name: str) -> bytes:
    value = obj.get(name, "")
    if not isinstance(value, str):
        raise _bad(endpoint, f"{name} is {value!r}, not base64")
    try:
        return base64.b64decode(value, validate=True)
    except binascii.Error:
        raise _bad(endpoint, f"{name} is {value!r}, not base64") from None


def _object(endpoint: str, obj: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise _bad(endpoint, f"{what} is {type(obj).__name__}, not an object")
    return obj


def header_revision(endpoint: str, answer: Any) -> int:
    header = _object(endpoint, _object(endpoint, answer, "answer").get("header", {}), "header")
    return _int(endpoint, header, "revision")


def parse_key_value(endpoint: str, obj: Any) -> KeyValue:
    kv = _object(endpoint, obj, "kv")
    return KeyValue(
        key=_bytes(endpoint, kv, "key"),
        value=_bytes(endpoint, kv, "value"),
        mod_revision=_int(endpoint, kv, "mod_revision"),
        lease=_int(endpoint, kv, "lease"),
    )


def parse_range(endpoint: str, answer: Any) -> tuple[int, list[KeyValue]]:
    """The store revision and the keys of a ``/v3/kv/range`` answer."""
    kvs = _object(endpoint, answer, "answer").get("kvs", [])
    if not isinstance(kvs, list):
        raise _bad(endpoint, f"kvs is {type(kvs).__name__}, not a list")
    return header_revision(endpoint, answer), [parse_key_value(endpoint, kv) for kv in kvs]


def parse_claim(endpoint: str, answer: Any) -> tuple[int, KeyValue | None]:
    """A :func:`claim_body` transaction's answer: the revision it put the key at
    (0 if it did not), and the key as it is when it did not (``None``: it
    vanished meanwhile)."""
    obj = _object(endpoint, answer, "answer")
    if obj.get("succeeded", False):
        return header_revision(endpoint, answer), None
    responses = obj.get("responses", [])
    if not isinstance(responses, list) or len(responses) != 1:
        raise _bad(endpoint, "a failed transaction without its one range answer")
    found = _object(
        endpoint,
        _object(endpoint, responses[0], "response").get("response_range", {}),
        "response_range",
    ).get("kvs", [])
    if not isinstance(found, list):
        raise _bad(endpoint, f"kvs is {type(found).__name__}, not a list")
    return 0, parse_key_value(endpoint, found[0]) if found else None


def parse_lease(endpoint: str, answer: Any) -> Lease:
    """A ``/v3/lease/grant`` answer, or the ``result`` of a keepalive line."""
    obj = _object(endpoint, answer, "answer")
    if "ID" not in obj:
        raise _bad(endpoint, "no lease ID in the answer")
    return Lease(id=_int(endpoint, obj, "ID"), ttl=_int(endpoint, obj, "TTL"))


def parse_stream_line(endpoint: str, answer: Any) -> Mapping[str, Any]:
    """The ``result`` of one line of a streamed answer; its ``error`` raised."""
    obj = _object(endpoint, answer, "stream line")
    if "error" in obj:
        error = obj["error"]
        if isinstance(error, Mapping):
            message = str(error.get("message", error))
            code = error.get("grpc_code", error.get("code"))
        else:
            message, code = str(error), obj.get("code")
        grpc_code = code if isinstance(code, int) and not isinstance(code, bool) else None
        raise MembershipError(endpoint, "rejected", message, grpc_code)
    return _object(endpoint, obj.get("result"), "result")


def parse_watch_message(endpoint: str, answer: Any) -> WatchMessage:
    """One line of a ``/v3/watch`` stream (``{"result": ...}``)."""
    result = parse_stream_line(endpoint, answer)
    events = result.get("events", [])
    if not isinstance(events, list):
        raise _bad(endpoint, f"events is {type(events).__name__}, not a list")
    parsed = []
    for event in events:
        event = _object(endpoint, event, "event")
        kind = event.get("type", "PUT")
        if kind not in ("PUT", "DELETE"):
            raise _bad(endpoint, f"event type {kind!r}")
        parsed.append(
            WatchEvent(
                "put" if kind == "PUT" else "delete", parse_key_value(endpoint, event.get("kv"))
            )
        )
    return WatchMessage(
        revision=header_revision(endpoint, result),
        events=tuple(parsed),
        created=bool(result.get("created", False)),
        canceled=bool(result.get("canceled", False)),
        compact_revision=_int(endpoint, result, "compact_revision"),
        cancel_reason=str(result.get("cancel_reason", "")),
    )


def parse_error_answer(endpoint: str, status: int, text: str, answer: Any) -> MembershipError:
    """The error for a non-2xx answer: etcd's message and gRPC code when it sent them."""
    if isinstance(answer, Mapping) and ("message" in answer or "error" in answer):
        code = answer.get("code")
        message = str(answer.get("message") or answer.get("error"))
        if isinstance(code, int) and not isinstance(code, bool):
            return MembershipError(endpoint, "rejected", f"{message} (HTTP {status})", code)
        return MembershipError(endpoint, "rejected", f"{message} (HTTP {status})")
    return _bad(endpoint, f"HTTP {status}: {text[:200]!r}")
