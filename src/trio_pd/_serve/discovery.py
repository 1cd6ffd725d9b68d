"""Where a membership service (etcd) plugs into the engine and the proxy.

``trio-pd engine`` and ``trio-pd proxy`` take an optional :class:`Membership`.
Without one (today: static ``--prefill`` / ``--decode`` URLs), nothing
changes. With one:

* the engine process calls :meth:`Membership.hold_registration` once its lifespan started
  and its HTTP server accepts requests (before it writes its ready file), and
  cancels it first thing when it drains, before it stops accepting: the proxy
  learns that the engine is leaving while the engine still answers;
* the proxy command calls :meth:`Membership.watch_engines` before it serves, and
  serves the engines it reports (see ``trio_pd._cli.proxy``).

:class:`EtcdMembership` is the one implementation: engines register on
etcd under a lease, the proxy watches the prefix (``trio_pd._membership``).
The CLI's ``membership_from_args`` builds it from ``--etcd``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

import attrs
import trio

from trio_pd._serve.openai import MODEL_NAME

if TYPE_CHECKING:
    from trio_pd._membership import EtcdAccess

Role = Literal["prefill", "decode"]


@attrs.frozen
class EngineAnnouncement:
    """What an engine registers: enough for a proxy to send it requests."""

    engine_id: str
    role: Role
    url: str  # the HTTP base URL that peers and the proxy dial (the advertised host)
    tp_size: int
    side_channel: str = ""  # host:port of rank 0's side channel ("": not said)
    incarnation: str = ""  # ("": a new one is made at registration)
    curve_public_key: str = ""  # its side channel's CURVE public key ("": none)


class EngineIdTaken(Exception):
    """Another live engine holds this engine's id: the engine does not start
    (one line, exit status 2)."""


@attrs.frozen
class EngineSet:
    """The engines a proxy serves: base URLs by role (each role may be empty)."""

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    problem: str | None = None
    """Why this view may be out of date (etcd unreachable: the last view), or ``None``."""
    members: tuple[EngineAnnouncement, ...] = ()
    """The registrations behind the URLs (with a membership: only verified ones)."""


class Membership(Protocol):
    """A registry of the deployment's engines (etcd with a lease, say)."""

    async def hold_registration(
        self,
        engine: EngineAnnouncement,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Register ``engine``, keep it registered, and withdraw it when cancelled.

        Calls ``task_status.started()`` once the registration is visible.
        Raises :class:`EngineIdTaken` if another live engine holds the id
        (exit status 2), anything else if the engine could not register
        (the engine then fails to start, exit status 1). It should not
        return while the engine serves; an exception then stops the engine. The engine waits for the
        withdrawal (at most its grace period) before it stops accepting.
        """
        ...

    async def watch_engines(
        self,
        update: Callable[[EngineSet], None],
        *,
        task_status: trio.TaskStatus[EngineSet] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Report the registered engines until cancelled.

        ``task_status.started(engines)`` with the first complete view, then
        ``update(engines)`` after every change.
        """
        ...


@attrs.frozen
class EtcdMembership:
    """:class:`Membership` on etcd: a key per engine under a lease, watched by the proxy.

    Attributes:
        url: etcd's client URL (``http://host:2379``).
        prefix: the key prefix (``/trio_pd/``).
        ttl: the lease: an engine that dies disappears within it.
        internal_key: the deployment's internal key: registrations are signed
            with a key derived from it, and the proxy routes only to engines
            whose registration verifies (``None``: unsigned, anyone who can
            write etcd can announce an engine).
        ca_file, cert_file, key_file: TLS to etcd (an ``https://`` URL): the
            CA its certificate chains to, a client certificate and key.
        user, password: etcd's authentication (``""``: none).
    """

    url: str
    prefix: str = "/trio_pd/"
    ttl: float = 10.0
    internal_key: str | None = attrs.field(default=None, repr=False)
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    user: str = ""
    password: str = attrs.field(default="", repr=False)

    def _access(self) -> EtcdAccess:
        from trio_pd._membership import EtcdAccess

        return EtcdAccess(self.ca_file, self.cert_file, self.key_file, self.user, self.password)

    def _signing_key(self) -> bytes | None:
        from trio_pd._membership import signing_key

        return None if self.internal_key is None else signing_key(self.internal_key)

    async def hold_registration(
        self,
        engine: EngineAnnouncement,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        from trio_pd._membership import Member, MembershipError, register

        host = engine.url.split("://", 1)[1].rsplit(":", 1)[0]
        member = Member(
            engine.role,
            engine.engine_id,
            engine.url,
            engine.side_channel or f"{host}:1",
            tp_size=engine.tp_size,
            model=MODEL_NAME,
            incarnation=engine.incarnation or secrets.token_hex(8),
            curve_public_key=engine.curve_public_key,
            timestamp=round(time.time(), 3),
        )
        try:
            async with register(
                self.url,
                member,
                prefix=self.prefix,
                ttl=self.ttl,
                signing_key=self._signing_key(),
                access=self._access(),
            ):
                task_status.started()
                await trio.sleep_forever()
        except MembershipError as exc:
            if exc.cause == "conflict":  # (only ever raised on entry)
                raise EngineIdTaken(exc.detail) from None
            raise

    async def watch_engines(
        self,
        update: Callable[[EngineSet], None],
        *,
        task_status: trio.TaskStatus[EngineSet] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        from trio_pd._membership import watch_members

        async with watch_members(
            self.url, prefix=self.prefix, signing_key=self._signing_key(), access=self._access()
        ) as view:

            def engines() -> EngineSet:
                problem = None
                if not view.healthy:
                    why = view.last_error or "not connected yet"
                    problem = f"etcd unreachable ({why}): routing by the last view"
                members = tuple(
                    EngineAnnouncement(
                        m.engine_id,
                        "prefill" if m.role == "prefill" else "decode",
                        m.url,
                        m.tp_size,
                        m.side_channel,
                        m.incarnation,
                        m.curve_public_key,
                    )
                    for m in view.members()
                    if m.role in ("prefill", "decode")
                )
                return EngineSet(
                    tuple(m.url for m in view.members("prefill")),
                    tuple(m.url for m in view.members("decode")),
                    problem,
                    members,
                )

            current = engines()
            task_status.started(current)
            while True:
                await view.changed.wait()
                # (The view also changes when a forged value is left out: the
                # engines stay the same, and the proxy is not told again.)
                if (latest := engines()) != current:
                    current = latest
                    update(current)
