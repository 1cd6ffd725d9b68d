"""Cluster members as etcd stores them, sans I/O: the record, its key, its value,
and the table a watcher keeps from a range and then watch events.

Key: ``{prefix}{role}/{engine_id}`` (``/trio_pd/prefill/prefill-0``).
Value: the member as a JSON object::

    {"role": "prefill", "engine_id": "prefill-0", "url": "http://10.1.4.17:8100",
     "side_channel": "10.1.4.17:5600", "tp_size": 1, "model": "tiny-llama",
     "incarnation": "3f9c...", "curve_public_key": "...", "timestamp": 1764700000.0,
     "signature": "5be1..."}

Fields this version does not know are ignored (a newer engine may add some);
a value that is not such an object, or whose role and engine id disagree
with its key, is *malformed*: the table leaves it out and says why, once per
version of the key.

**Signatures.** With the deployment's internal key, every value carries
``signature``: HMAC-SHA256, under a key derived from the internal key
(:func:`signing_key`), of the value's canonical JSON without ``signature``
(sorted keys, no spaces) -- every field, the unknown ones too. A reader
with the key leaves out (and counts) a value whose signature is missing or
wrong: whoever can write etcd but lacks the internal key cannot announce an
engine, nor change a field of a real one.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from trio_pd._membership._etcd_wire import KeyValue, WatchEvent

DEFAULT_PREFIX = "/trio_pd/"
DEFAULT_TTL = 10.0  # seconds
SIGNATURE = "signature"


def signing_key(internal_key: str) -> bytes:
    """The key that signs and verifies registrations, derived from the internal key
    (so that a registration's signature says nothing usable about the key itself)."""
    return hmac.new(internal_key.encode(), b"trio_pd membership v1", hashlib.sha256).digest()


def _canonical(obj: Mapping[str, Any]) -> bytes:
    fields = {name: value for name, value in obj.items() if name != SIGNATURE}
    return json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()


def _sign(key: bytes, obj: Mapping[str, Any]) -> str:
    return hmac.new(key, _canonical(obj), hashlib.sha256).hexdigest()


class UnverifiedError(ValueError):
    """A value whose signature is missing or does not verify."""


def _name(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value or "/" in value:
        raise ValueError(f"{attribute.name} {value!r} is not a non-empty string without '/'")


def _side_channel(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    """``host:port`` (an IPv6 host in brackets)."""
    host, sep, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    bracketed = host.startswith("[") and host.endswith("]")
    if not sep or not host or (":" in host and not bracketed):
        raise ValueError(f"side_channel {value!r} is not host:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"side_channel {value!r} is not host:port")


def _url(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise ValueError(f"url {value!r} is not an http(s) URL")


def _tp_size(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"tp_size {value!r} is not a positive integer")


def _timestamp(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise ValueError(f"timestamp {value!r} is not a time")


def _text(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str):
        raise ValueError(f"{attribute.name} {value!r} is not a string")


@attrs.frozen
class Member:
    """An engine of the cluster, as it registers itself in etcd.

    Attributes:
        role: ``"prefill"`` or ``"decode"`` (any name without ``/``).
        engine_id: unique within its role (no ``/``).
        url: the engine's HTTP base URL (``http://host:port``), for the proxy.
        side_channel: ``host:port`` of its connector's side channel (rank 0's
            port for a tensor-parallel engine), for decoders.
        tp_size: its tensor-parallel size.
        model: the model it serves.
        incarnation: changes every time the engine starts (a restarted
            engine is a new incarnation under the same key).
        curve_public_key: the engine's CURVE public key for its side
            channel (Z85), or ``""``.
        timestamp: when the engine registered (seconds since the epoch).
    """

    role: str = attrs.field(validator=_name)
    engine_id: str = attrs.field(validator=_name)
    url: str = attrs.field(validator=_url)
    side_channel: str = attrs.field(validator=_side_channel)
    tp_size: int = attrs.field(default=1, validator=_tp_size)
    model: str = attrs.field(default="", validator=_text)
    incarnation: str = attrs.field(default="", validator=_text)
    curve_public_key: str = attrs.field(default="", validator=_text)
    timestamp: float = attrs.field(default=0.0, validator=_timestamp)

    def key(self, prefix: str) -> bytes:
        """``{prefix}{role}/{engine_id}``, as etcd's key."""
        return f"{prefix}{self.role}/{self.engine_id}".encode()

    def to_json(self, key: bytes | None = None) -> bytes:
        """The value to store: signed (``signature``) when a :func:`signing_key` is given."""
        obj: dict[str, Any] = attrs.asdict(self)
        if key is not None:
            obj[SIGNATURE] = _sign(key, obj)
        return json.dumps(obj, sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes, key: bytes | None = None) -> Member:
        """The member in ``data``; with ``key`` (a :func:`signing_key`), only if its
        signature verifies.

        Raises:
            UnverifiedError: ``key`` is given and the signature is missing or wrong.
            ValueError: ``data`` is not a member's JSON object (the message says why).
        """
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"not JSON ({exc})") from None
        if not isinstance(obj, Mapping):
            raise ValueError(f"a JSON {type(obj).__name__}, not an object")
        if key is not None:
            signature = obj.get(SIGNATURE)
            if not isinstance(signature, str) or not signature:
                raise UnverifiedError("not signed (no signature)")
            if not hmac.compare_digest(signature, _sign(key, obj)):
                raise UnverifiedError("its signature does not verify")
        names = [field.name for field in attrs.fields(cls)]
        missing = [name for name in names[:4] if name not in obj]
        if missing:
            raise ValueError(f"missing {', '.join(missing)}")
        return cls(**{name: obj[name] for name in names if name in obj})


def check_prefix(prefix: str) -> str:
    """``prefix`` if usable as a key prefix (non-empty, ending in ``/``)."""
    if not prefix or not prefix.endswith("/"):
        raise ValueError(f"the etcd key prefix {prefix!r} must be non-empty and end with '/'")
    return prefix


class MemberTable:
    """The live members under a prefix: loaded from a range, kept by watch events.

    Pure bookkeeping: :meth:`load` and :meth:`apply` say whether the members
    changed; :meth:`take_problems` returns what was ignored, and why, for
    the caller to log (each malformed key once per revision of it). With
    ``key`` (a :func:`signing_key`), a value whose signature does not verify
    is left out too, and counted in :attr:`unverified` (once per revision).
    """

    def __init__(self, prefix: str, key: bytes | None = None) -> None:
        self.prefix = check_prefix(prefix)
        self._prefix = prefix.encode()
        self._key = key
        self.unverified = 0  # values left out because their signature did not verify
        self._members: dict[bytes, Member] = {}
        self._reported: dict[bytes, int] = {}  # malformed key -> its revision reported
        self._problems: list[str] = []

    def members(self, role: str | None = None) -> tuple[Member, ...]:
        """The live members (of ``role`` if given), by role then engine id."""
        chosen = (m for m in self._members.values() if role is None or m.role == role)
        return tuple(sorted(chosen, key=lambda m: (m.role, m.engine_id)))

    def __len__(self) -> int:
        return len(self._members)

    def load(self, kvs: Iterable[KeyValue]) -> bool:
        """Replace every member by those of a range's keys; whether that changed them."""
        members = {}
        kvs = list(kvs)
        present = {kv.key for kv in kvs}
        self._reported = {k: r for k, r in self._reported.items() if k in present}
        for kv in kvs:
            member = self._decode(kv)
            if member is not None:
                members[kv.key] = member
        changed = members != self._members
        self._members = members
        return changed

    def apply(self, events: Iterable[WatchEvent]) -> bool:
        """Apply a watch message's events in order; whether the members changed."""
        before = dict(self._members)
        for event in events:
            if event.kind == "delete":
                self._members.pop(event.kv.key, None)
                self._reported.pop(event.kv.key, None)
                continue
            member = self._decode(event.kv)
            if member is None:
                self._members.pop(event.kv.key, None)  # (a malformed new version)
            else:
                self._members[event.kv.key] = member
        return self._members != before

    def take_problems(self) -> list[str]:
        """What was ignored since the last call (one line each)."""
        problems, self._problems = self._problems, []
        return problems

    def _decode(self, kv: KeyValue) -> Member | None:
        try:
            member = Member.from_json(kv.value, self._key)
            if kv.key != member.key(self.prefix):
                raise ValueError(f"its role and engine_id make the key {member.key(self.prefix)!r}")
        except (ValueError, TypeError) as exc:
            if self._reported.get(kv.key) != kv.mod_revision:
                self._reported[kv.key] = kv.mod_revision
                if isinstance(exc, UnverifiedError):
                    self.unverified += 1
                self._problems.append(
                    f"ignoring {kv.key.decode(errors='replace')!r} "
                    f"(revision {kv.mod_revision}): {exc}"
                )
            return None
        return member
