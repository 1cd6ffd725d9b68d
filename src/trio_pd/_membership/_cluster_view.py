"""The proxy's view of the cluster: the members under a prefix, read then watched.

See :mod:`trio_pd._membership` for the whole picture.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import attrs
import trio

from trio_pd._exception_groups import unwrapped_errors
from trio_pd._membership._etcd_client import EtcdAccess, EtcdClient, MembershipConfig
from trio_pd._membership._etcd_wire import MembershipError
from trio_pd._membership._members import DEFAULT_PREFIX, Member, MemberTable, check_prefix

logger = logging.getLogger("trio_pd.membership")


@attrs.frozen
class ViewStatistics:
    """A :class:`ClusterView`'s state (for ``/health`` and metrics)."""

    healthy: bool
    members: int
    revision: int  # of the last change seen
    last_error: str | None
    outages: int  # times etcd was lost
    reloads: int  # full reads of the prefix
    unverified: int = 0  # values left out: their signature did not verify (once per revision)


class ClusterView:
    """The live members under a prefix, as :func:`watch_members` keeps them."""

    def __init__(self, client: EtcdClient, prefix: str, signing_key: bytes | None = None) -> None:
        self._client = client
        self._prefix = prefix.encode()
        self._table = MemberTable(prefix, signing_key)
        self._revision = 0
        self._healthy = False
        self._last_error: MembershipError | None = None
        self._down_since: float | None = None
        self._changed = trio.Event()
        self._outages = 0
        self._reloads = 0

    def members(self, role: str | None = None) -> tuple[Member, ...]:
        """The live members (of ``role`` if given), by role then engine id."""
        return self._table.members(role)

    @property
    def healthy(self) -> bool:
        """Whether the view is connected to etcd and watching (if not, it shows the
        members as they were when etcd was lost)."""
        return self._healthy

    @property
    def last_error(self) -> MembershipError | None:
        """Why etcd was lost, the last time it was (kept after it is back)."""
        return self._last_error

    @property
    def changed(self) -> trio.Event:
        """An event set at the next change of the members, of ``healthy``, or of
        ``statistics().unverified`` (a value left out because it is not signed).

        A new event replaces it then: read the state, then
        ``await view.changed.wait()``, and read it again.
        """
        return self._changed

    def statistics(self) -> ViewStatistics:
        return ViewStatistics(
            healthy=self._healthy,
            members=len(self._table),
            revision=self._revision,
            last_error=None if self._last_error is None else str(self._last_error),
            outages=self._outages,
            reloads=self._reloads,
            unverified=self._table.unverified,
        )

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    def _log_problems(self) -> None:
        for problem in self._table.take_problems():
            logger.warning("etcd view: %s", problem)

    async def _reload(self) -> None:
        revision, kvs = await self._client.range_prefix(self._prefix)
        self._revision = revision
        self._reloads += 1
        unverified = self._table.unverified
        changed = self._table.load(kvs)
        self._log_problems()
        if changed or self._table.unverified != unverified:
            self._notify()

    def _watching(self) -> None:
        if self._healthy:
            return
        if self._down_since is not None:
            logger.warning(
                "etcd at %s is back after %.1f s: watching %s again (%d members)",
                self._client.url,
                trio.current_time() - self._down_since,
                self._prefix.decode(),
                len(self._table),
            )
        self._healthy, self._down_since = True, None
        self._notify()

    def _lost(self, error: MembershipError) -> None:
        self._last_error = error
        if not self._healthy:
            return
        logger.warning(
            "lost etcd (%s): keeping the last view (%d members) and reconnecting",
            error,
            len(self._table),
        )
        self._healthy, self._down_since = False, trio.current_time()
        self._outages += 1
        self._notify()

    async def _keep_watching(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Watch, and reconnect, until cancelled. Reports started once first watching.

        Raises:
            MembershipError: only before it started (the first watch failed).
        """
        config = self._client.config
        started = False
        delay = config.retry_initial

        def watching() -> None:
            nonlocal started, delay
            self._watching()
            delay = config.retry_initial
            if not started:
                started = True
                task_status.started()

        reload = False  # (watch_members read the prefix just before)
        while True:
            try:
                if reload:
                    await self._reload()
                reload = True
                await self._watch(watching)
            except MembershipError as exc:
                if not started:
                    raise
                self._lost(exc)
                await trio.sleep(delay)
                delay = min(2 * delay, config.retry_max)

    async def _watch(self, watching: Callable[[], None]) -> None:
        """Follow the prefix from the next revision, probing etcd meanwhile.

        Returns when etcd cancelled the watch because its start revision was
        compacted (read the prefix again). Raises :class:`MembershipError`
        when the stream or the probe fails.
        """
        failure: MembershipError | None = None
        async with trio.open_nursery() as nursery:

            async def probe() -> None:
                nonlocal failure
                try:
                    while True:
                        await trio.sleep(self._client.config.probe_interval)
                        await self._client.probe(self._prefix)
                except MembershipError as exc:
                    failure = exc
                    nursery.cancel_scope.cancel()

            nursery.start_soon(probe)
            try:
                await self._follow(watching)
            except MembershipError as exc:
                failure = exc
            nursery.cancel_scope.cancel()
        if failure is not None:
            raise failure

    async def _follow(self, watching: Callable[[], None]) -> None:
        endpoint = f"{self._client.url}/v3/watch"
        async with self._client.watch(self._prefix, self._revision + 1) as messages:
            async for message in messages:
                if message.canceled:
                    if message.compact_revision:
                        logger.info(
                            "etcd compacted revision %d away: reading %s again",
                            self._revision + 1,
                            self._prefix.decode(),
                        )
                        return
                    reason = message.cancel_reason or "no reason given"
                    raise MembershipError(endpoint, "rejected", f"watch cancelled: {reason}")
                if message.created:
                    watching()
                if message.events:
                    self._revision = max(e.kv.mod_revision for e in message.events)
                    unverified = self._table.unverified
                    changed = self._table.apply(message.events)
                    self._log_problems()
                    if changed or self._table.unverified != unverified:
                        self._notify()


@asynccontextmanager
async def watch_members(
    etcd_url: str,
    *,
    prefix: str = DEFAULT_PREFIX,
    config: MembershipConfig | None = None,
    signing_key: bytes | None = None,
    access: EtcdAccess | None = None,
) -> AsyncIterator[ClusterView]:
    """Keep a :class:`ClusterView` of the members under ``prefix`` while the block runs.

    With ``signing_key`` (:func:`~trio_pd._membership._members.signing_key`),
    only members whose value is signed with it are in the view; the others
    are left out, logged once per version of their key, and counted
    (``statistics().unverified``).

    On entry the prefix is read and watched: the view is complete and
    healthy. Later, if etcd goes away, the view keeps its members, turns
    unhealthy and reconnects (``config.retry_initial`` doubling to
    ``config.retry_max``); back, it reads the prefix again and watches on.

    ``access``: TLS files and etcd's user (:class:`EtcdAccess`).

    Raises:
        MembershipError: etcd could not be read or watched on entry.
        ValueError: a bad ``prefix`` (non-empty, ending in ``/``).

    Resource handling: the watch task and the HTTP connections end with
    the block.
    """
    check_prefix(prefix)
    async with EtcdClient(etcd_url, config, access) as client:
        view = ClusterView(client, prefix, signing_key)
        await view._reload()
        async with unwrapped_errors(), trio.open_nursery() as nursery:
            await nursery.start(view._keep_watching)
            try:
                yield view
            finally:
                nursery.cancel_scope.cancel()
