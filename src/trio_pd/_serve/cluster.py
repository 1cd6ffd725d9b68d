"""The proxy's engines from etcd: follow a
:class:`~trio_pd._membership._cluster_view.ClusterView`."""

from __future__ import annotations

from trio_pd._membership._cluster_view import ClusterView
from trio_pd._serve.proxy import Proxy

ROLES = ("prefill", "decode")


async def follow_cluster(proxy: Proxy, view: ClusterView) -> None:
    """Keep ``proxy``'s engine sets equal to ``view``'s live members, until cancelled.

    While etcd is away the view keeps its last members, so the proxy goes on
    routing to them (an engine that died meanwhile is passed over at its
    first refused connection); ``proxy.membership_problem`` says so, for
    ``/health``. An engine that registers is routed to as soon as the view
    sees it, without restarting anything.
    """
    while True:
        changed = view.changed
        for role in ROLES:
            proxy.set_engines(role, [member.url for member in view.members(role)])
        if view.healthy:
            proxy.membership_problem = None
        else:
            why = view.last_error or "not connected yet"
            proxy.membership_problem = f"etcd unreachable ({why}): routing by the last view"
        await changed.wait()
