"""Cluster members as etcd stores them, sans I/O: the record, its key, its value,
and the table a watcher keeps from a range and then watch events.

Key: ``{prefix}{role}/{engine_id}`` (``/trio_pd/prefill/prefill-0``).
Value: the member as a JSON object::

    {"role": "prefill", "engine_id": "prefill-0", "url": "http://10.1.4.17:8100",
     "side_channel": "10.1.4.17:5600", "tp_size": 1, "model": "tiny-llama",
     "incarnation": "3f9c..."}

Fields this version does not know are ignored (a newer engine may add some);
a value that is not such an object, or whose role and engine id disagree
with its key, is *malformed*: the table leaves it out and says why, once per
version of the key.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping

import attrs

from trio_pd._membership._etcd_wire import KeyValue, WatchEvent

DEFAULT_PREFIX = "/trio_pd/"
DEFAULT_TTL = 10.0  # seconds


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
    """

    role: str = attrs.field(validator=_name)
    engine_id: str = attrs.field(validator=_name)
    url: str = attrs.field(validator=_url)
    side_channel: str = attrs.field(validator=_side_channel)
    tp_size: int = attrs.field(default=1, validator=_tp_size)
    model: str = attrs.field(default="", validator=_text)
    incarnation: str = attrs.field(default="", validator=_text)

    def key(self, prefix: str) -> bytes:
        """``{prefix}{role}/{engine_id}``, as etcd's key."""
        return f"{prefix}{self.role}/{self.engine_id}".encode()

    def to_json(self) -> bytes:
        return json.dumps(attrs.asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> Member:
        """The member in ``data``.

        Raises:
            ValueError: ``data`` is not a member's JSON object (the message says why).
        """
        try:
            obj = json.loads(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ValueError(f"not JSON ({exc})") from None
        if not isinstance(obj, Mapping):
            raise ValueError(f"a JSON {type(obj).__name__}, not an object")
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
    the caller to log (each malformed key once per revision of it).
    """

    def __init__(self, prefix: str) -> None:
        self.prefix = check_prefix(prefix)
        self._prefix = prefix.encode()
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
            member = Member.from_json(kv.value)
            if kv.key != member.key(self.prefix):
                raise ValueError(f"its role and engine_id make the key {member.key(self.prefix)!r}")
        except (ValueError, TypeError) as exc:
            if self._reported.get(kv.key) != kv.mod_revision:
                self._reported[kv.key] = kv.mod_revision
                self._problems.append(
                    f"ignoring {kv.key.decode(errors='replace')!r} "
                    f"(revision {kv.mod_revision}): {exc}"
                )
            return None
        return member
