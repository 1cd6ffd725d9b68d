"""An engine's registration in etcd: a key under a lease, kept alive, withdrawn on exit.

See :mod:`trio_pd._membership` for the whole picture.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from trio_pd._exception_groups import unwrapped_errors
from trio_pd._membership._etcd_client import EtcdClient, MembershipConfig
from trio_pd._membership._etcd_wire import NOT_FOUND, MembershipError
from trio_pd._membership._members import DEFAULT_PREFIX, DEFAULT_TTL, Member, check_prefix

logger = logging.getLogger("trio_pd.membership")


class Registration:
    """An engine's key in etcd, kept alive by :func:`register`'s background task.

    Attributes:
        member: what is registered.
        key: its etcd key.
    """

    def __init__(self, client: EtcdClient, member: Member, prefix: str, ttl: float) -> None:
        self.member = member
        self.key = member.key(prefix).decode()
        self._client = client
        self._value = member.to_json()
        self._ttl = math.ceil(ttl)
        self._interval = ttl / 3
        self._lease: int | None = None
        self._stored = False  # the key was put under self._lease
        self._registrations = 0
        self._healthy = False
        self._last_error: MembershipError | None = None
        self._withdrawn = False
        self._keepalive = trio.CancelScope()

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
        """How many times the key was put under a new lease (1 unless a lease was lost)."""
        return self._registrations

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

    async def _step(self) -> None:
        """One step to stay registered: grant a lease and put the key, or renew the lease.

        Raises:
            MembershipError: etcd could not be reached, or refused.
        """
        if self._lease is None:
            lease = await self._client.grant(self._ttl)
            self._lease, self._interval = lease.id, max(lease.ttl, 1) / 3
        if not self._stored:
            try:
                await self._client.put(self.key.encode(), self._value, lease=self._lease)
            except MembershipError as exc:
                if exc.code == NOT_FOUND:  # the lease expired before the put: a new one
                    self._lease = None
                raise
            self._stored = True
            self._registrations += 1
            if self._registrations > 1:
                logger.warning("registered %s again, under a new lease", self.key)
            return
        if await self._client.keepalive(self._lease) <= 0:
            logger.warning("the lease of %s expired: registering again", self.key)
            self._lease, self._stored = None, False
            await self._step()

    async def _register(self) -> None:
        await self._step()
        self._healthy = True
        logger.info("registered %s (lease %x, TTL %d s)", self.key, self._lease or 0, self._ttl)

    async def _keep_alive(self) -> None:
        with self._keepalive:
            while True:
                await trio.sleep(self._interval)
                try:
                    await self._step()
                except MembershipError as exc:
                    self._last_error = exc
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


@asynccontextmanager
async def register(
    etcd_url: str,
    member: Member,
    *,
    prefix: str = DEFAULT_PREFIX,
    ttl: float = DEFAULT_TTL,
    config: MembershipConfig | None = None,
) -> AsyncIterator[Registration]:
    """Register ``member`` in etcd while the block runs.

    ``ttl``: seconds the key outlives the engine's last keepalive (rounded
    up to whole seconds; etcd raises it to its minimum, 2 s with its default
    election timeout). The lease is renewed every ``ttl / 3`` s.

    Raises:
        MembershipError: the first registration failed (etcd unreachable,
            or it refused): the engine is not registered. Later failures
            are retried in the background and logged, never raised.
        ValueError: a bad ``prefix`` (non-empty, ending in ``/``) or ``ttl``.

    Resource handling: on exit (normal, error or cancellation) the key is
    deleted and the lease revoked (:meth:`Registration.withdraw`).
    """
    check_prefix(prefix)
    if not ttl > 0:
        raise ValueError(f"ttl must be > 0, not {ttl!r}")
    async with EtcdClient(etcd_url, config) as client:
        registration = Registration(client, member, prefix, ttl)
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
