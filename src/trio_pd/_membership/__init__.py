"""Cluster membership on etcd: engines register under a lease; the proxy watches.

* :func:`register` (an engine): grants a lease of ``ttl`` seconds, puts the
  engine's :class:`~trio_pd._membership._members.Member` at ``{prefix}{role}/{engine_id}``
  under it, and renews the lease every ``ttl / 3`` s. When etcd cannot be
  reached it keeps trying (logging once per outage); if the lease expired
  meanwhile (etcd answers a keepalive with TTL 0) it registers again under a
  new lease. On exit, or :meth:`Registration.withdraw` when the engine
  starts draining, it deletes the key and revokes the lease.
* :func:`watch_members` (the proxy): reads the prefix, then watches it from
  the next revision, keeping a :class:`ClusterView` of the live members.
  When etcd goes away the view keeps its last members, turns unhealthy
  (``healthy``, ``last_error``; logged once per outage) and reconnects with
  backoff; when etcd is back it reads the prefix again (nothing missed) and
  watches on.

With the deployment's internal key (:func:`signing_key` derives the key
that signs), every value is signed and every reader leaves out (counts, and
logs once) a value that does not verify; a registration puts its key back
at once when someone else deletes it or overwrites it with such a value,
and refuses to start when another live engine holds its key (a
``"conflict"``).

A member disappears when its key is deleted: at once when the engine exits
cleanly, within its TTL when it dies (its lease is no longer renewed).

The modules: etcd's v3 JSON gateway as request bodies and parsed answers
(sans I/O) in ``_etcd_wire``; the HTTP client (httpx2) and
:class:`MembershipConfig` in ``_etcd_client``; the member records and the
view's table (sans I/O) in ``_members``; the engine side in
``_registration``; the proxy side in ``_cluster_view``. This package gathers
their names. It may import ``_core``; the serving layer plugs it in through
``trio_pd._serve.discovery``.
"""

from trio_pd._membership._cluster_view import ClusterView, ViewStatistics, watch_members
from trio_pd._membership._etcd_client import EtcdAccess, MembershipConfig
from trio_pd._membership._etcd_wire import MembershipError
from trio_pd._membership._members import DEFAULT_PREFIX, DEFAULT_TTL, Member, signing_key
from trio_pd._membership._registration import Registration, register

__all__ = [
    "DEFAULT_PREFIX",
    "DEFAULT_TTL",
    "ClusterView",
    "EtcdAccess",
    "Member",
    "MembershipConfig",
    "MembershipError",
    "Registration",
    "ViewStatistics",
    "register",
    "signing_key",
    "watch_members",
]
