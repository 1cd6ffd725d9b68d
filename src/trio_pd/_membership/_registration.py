"""An engine's registration in etcd: a key under a lease, kept alive, withdrawn on exit.

See :mod:`trio_pd._membership` for the whole picture.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from trio_pd._exception_groups import unwrapped_errors
from trio_pd._membership._etcd_client import EtcdAccess, EtcdClient, MembershipConfig
from trio_pd._membership._etcd_wire import NOT_FOUND, KeyValue, MembershipError
from trio_pd._membership._members import DEFAULT_PREFIX, DEFAULT_TTL, Member, check_prefix

logger = logging.getLogger("trio_pd.membership")


class Registration:
    """An engine's key in etcd, kept alive by :func:`register`'s background tasks.

    Attributes:
        member: what is registered.
        key: its etcd key.
    """

    def __init__(
        self,
        client: EtcdClient,
        member: Member,
        prefix: str,
        ttl: float,
        signing_key: bytes | None = None,
    ) -> None:
        self.member = member
        self.key = member.key(prefix).decode()
        self._prefix = prefix
        self._client = client
        self._signing_key = signing_key
        self._value = member.to_json(signing_key)
        self._ttl = math.ceil(ttl)
        self._interval = ttl / 3
        self._lease: int | None = None
        self._stored = False  # the key was put under self._lease
        self._put_revision = 0  # (events before it are stale)
        self._registrations = 0
        self._restorations = 0
        self._healthy = False
        self._last_error: MembershipError | None = None
        self._withdrawn = False
        self._keepalive = trio.CancelScope()
        self._watching = trio.CancelScope()
        self._lock = trio.Lock()  # (one step at a time: the renewal and the guard)
        self._held_by: str | None = None  # another engine's registration, reported once

    @property
    def lease_id(self) -> int | None:
        """The lease the key is under (``None`` between a lost lease and a new one)."""
        return self._lease

    @property
    def healthy(self) -> bool:
        """Whether etcd accepted the last registration or keepalive."""
        return self._healthy

    @property
    def last_error(self) -> MembershipError | None:
        """The latest failure to reach etcd (kept after it recovered)."""
        return self._last_error

    @property
    def registrations(self) -> int:
        """How many times the key was put (1 unless a lease was lost or the key put back)."""
        return self._registrations

    @property
    def restorations(self) -> int:
        """How many times the key was put back after someone else deleted or changed it."""
        return self._restorations

    async def withdraw(self) -> None:
        """Delete the key and revoke the lease now, and stop renewing it.

        For an engine that starts draining: the proxy stops sending it new
        requests while it finishes the ones it has. Bounded by
        ``MembershipConfig.close_timeout`` and shielded from cancellation;
        best effort: a failure is logged (the lease's TTL removes the key
        anyway). Idempotent; :func:`register` calls it on exit.
        """
        if self._withdrawn:
            await trio.lowlevel.checkpoint()
            return
        self._withdrawn = True
        self._keepalive.cancel()
        self._healthy = False
        if self._lease is None and not self._stored:
            await trio.lowlevel.checkpoint()
            return
        with trio.move_on_after(self._client.config.close_timeout, shield=True) as scope:
            try:
                if self._stored:
                    await self._client.delete(self.key.encode())
                if self._lease is not None:
                    await self._client.revoke(self._lease)
            except MembershipError as exc:
                logger.warning("could not withdraw %s (its TTL removes it): %s", self.key, exc)
                return
        if scope.cancelled_caught:
            logger.warning("withdrawing %s timed out (its TTL removes it)", self.key)
        else:
            logger.info("withdrew %s", self.key)

    def _holder(self, kv: KeyValue) -> Member | None:
        """The engine whose valid registration ``kv`` is (not this one's), or ``None``
        (a value that is not one: malformed, or not signed with the deployment's key)."""
        if kv.value == self._value:
            return None
        try:
            other = Member.from_json(kv.value, self._signing_key)
        except (ValueError, TypeError):
            return None
        return other if other.key(self._prefix).decode() == self.key else None

    async def _claim(self) -> None:
        """Put the key under the lease, unless another live engine holds the id.

        One transaction per attempt: the key is put if it is absent, or if it
        is still the value seen (a value that is not a registration of the
        deployment is overwritten).

        Raises:
            MembershipError: ``"conflict"`` when another engine's registration
                holds the key; or etcd failed.
        """
        assert self._lease is not None
        key, mod_revision = self.key.encode(), 0
        for _ in range(8):
            revision, current = await self._client.claim(
                key, self._value, lease=self._lease, mod_revision=mod_revision
            )
            if revision:
                self._put_revision = revision
                return
            if current is None:  # (deleted meanwhile)
                mod_revision = 0
                continue
            if current.value == self._value and current.lease == self._lease:
                self._put_revision = current.mod_revision
                return
            other = self._holder(current)
            if other is not None:
                raise MembershipError(
                    self._client.url,
                    "conflict",
                    f"engine id {self.member.engine_id!r} is held by a live engine "
                    f"({other.url}, incarnation {other.incarnation!r}); "
                    "it is free once that engine leaves",
                )
            mod_revision = current.mod_revision  # (not a registration: overwrite it)
        raise MembershipError(self._client.url, "conflict", f"{self.key} keeps changing")

    async def _step(self) -> None:
        """One step to stay registered: grant a lease and put the key, or renew the lease.

        Raises:
            MembershipError: etcd could not be reached, or refused.
        """
        async with self._lock:
            await self._step_locked()

    async def _step_locked(self) -> None:
        # (a lease kept while another engine held the key: renewed, or a new one)
        renew = self._lease is not None and not self._stored
        if renew and self._lease is not None and await self._client.keepalive(self._lease) <= 0:
            self._lease = None
        if self._lease is None:
            lease = await self._client.grant(self._ttl)
            self._lease, self._interval = lease.id, max(lease.ttl, 1) / 3
        if not self._stored:
            try:
                await self._claim()
            except MembershipError as exc:
                if exc.code == NOT_FOUND:  # the lease expired before the put: a new one
                    self._lease = None
                raise
            self._stored, self._held_by = True, None
            self._registrations += 1
            if self._registrations > 1:
                logger.warning("registered %s again", self.key)
            return
        if await self._client.keepalive(self._lease) <= 0:
            logger.warning("the lease of %s expired: registering again", self.key)
            self._lease, self._stored = None, False
            await self._step_locked()

    async def _register(self) -> None:
        await self._step()
        self._healthy = True
        logger.info("registered %s (lease %x, TTL %d s)", self.key, self._lease or 0, self._ttl)

    async def _keep_alive(self) -> None:
        with self._keepalive:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._renew)
                nursery.start_soon(self._guard)

    async def _renew(self) -> None:
        while True:
            await trio.sleep(self._interval)
            try:
                await self._step()
            except MembershipError as exc:
                self._last_error = exc
                self._watching.cancel()  # (the guard's watch may hang: it starts again)
                if self._healthy:
                    logger.warning(
                        "cannot keep %s registered, retrying every %.1f s: %s",
                        self.key,
                        self._interval,
                        exc,
                    )
                self._healthy = False
                continue
            if not self._healthy:
                logger.warning("etcd answers again: %s is registered", self.key)
            self._healthy = True

    async def _guard(self) -> None:
        """Watch the key, and put it back at once when someone else deletes or changes it."""
        key = self.key.encode()
        while True:
            with trio.CancelScope() as self._watching:
                try:
                    revision, current = await self._client.get(key)
                    await self._check(current or KeyValue(key, mod_revision=revision))
                    async with self._client.watch(key, revision + 1) as messages:
                        async for message in messages:
                            for event in message.events:
                                if event.kv.key == key:
                                    await self._check(event.kv, deleted=event.kind == "delete")
                except MembershipError:
                    pass  # (the renewal reports etcd's outages)
            await trio.sleep(self._interval)

    async def _check(self, kv: KeyValue, *, deleted: bool = False) -> None:
        """React to the key as ``kv`` (``deleted``, or empty: it is absent)."""
        if not kv.value:
            deleted = True
        if self._withdrawn or not self._stored or (not deleted and kv.value == self._value):
            return
        if kv.mod_revision < self._put_revision:
            return  # (an event from before the key was last put)
        if deleted:  # (a delete event carries no revision of its own: is the key ours now?)
            _, current = await self._client.get(kv.key)
            if current is not None and current.value == self._value:
                return
        other = None if deleted else self._holder(kv)
        if other is not None:  # another engine with this id registered (our lease had lapsed)
            self._stored = False  # (the renewal claims the key once that engine left)
            if self._held_by != other.incarnation:
                self._held_by = other.incarnation
                logger.error(
                    "engine id %s is now registered by another engine (%s): waiting for it "
                    "to leave",
                    self.key,
                    other.url,
                )
            return
        what = "deleted" if deleted else "overwritten by a value that is not a registration"
        logger.warning("%s was %s: putting it back", self.key, what)
        self._stored = False
        self._restorations += 1
        with contextlib.suppress(MembershipError):  # (the renewal retries)
            await self._step()


@asynccontextmanager
async def register(
    etcd_url: str,
    member: Member,
    *,
    prefix: str = DEFAULT_PREFIX,
    ttl: float = DEFAULT_TTL,
    config: MembershipConfig | None = None,
    signing_key: bytes | None = None,
    access: EtcdAccess | None = None,
) -> AsyncIterator[Registration]:
    """Register ``member`` in etcd while the block runs.

    ``ttl``: seconds the key outlives the engine's last keepalive (rounded
    up to whole seconds; etcd raises it to its minimum, 2 s with its default
    election timeout). The lease is renewed every ``ttl / 3`` s.
    ``signing_key`` (:func:`~trio_pd._membership._members.signing_key`): the
    value is signed, and the readers with the same key trust only signed
    values.

    The registration also watches its key: when someone else deletes it or
    overwrites it with a value that is not a registration (not signed with
    ``signing_key``), it puts it back at once (``restorations`` counts it).

    ``access``: TLS files and etcd's user (:class:`EtcdAccess`).

    Raises:
        MembershipError: the first registration failed (etcd unreachable,
            or it refused; ``"conflict"``: another live engine holds the
            key): the engine is not registered. Later failures
            are retried in the background and logged, never raised.
        ValueError: a bad ``prefix`` (non-empty, ending in ``/``) or ``ttl``.

    Resource handling: on exit (normal, error or cancellation) the key is
    deleted and the lease revoked (:meth:`Registration.withdraw`).
    """
    check_prefix(prefix)
    if not ttl > 0:
        raise ValueError(f"ttl must be > 0, not {ttl!r}")
    async with EtcdClient(etcd_url, config, access) as client:
        registration = Registration(client, member, prefix, ttl, signing_key)
        try:
            await registration._register()
            async with unwrapped_errors(), trio.open_nursery() as nursery:
                nursery.start_soon(registration._keep_alive)
                try:
                    yield registration
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            await registration.withdraw()  # noqa: ASYNC102 -- shielded and bounded inside
