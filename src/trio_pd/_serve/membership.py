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

``--etcd URL`` is accepted by both commands but not wired yet: the CLI's
``membership_from_args`` is the one place that builds a :class:`Membership`
from the flags.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Protocol

import attrs
import trio

Role = Literal["prefill", "decode"]


@attrs.frozen
class EngineAnnouncement:
    """What an engine registers: enough for a proxy to send it requests."""

    engine_id: str
    role: Role
    url: str  # the HTTP base URL that peers and the proxy dial (the advertised host)
    tp_size: int


@attrs.frozen
class EngineSet:
    """The engines a proxy serves: base URLs by role (each role may be empty)."""

    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()


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
        Raises if the engine could not register (the engine then fails to
        start, exit status 1). It should not return while the engine serves;
        an exception then stops the engine. The engine waits for the
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
