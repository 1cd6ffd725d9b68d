"""Cluster membership on etcd: members, registrations, the proxy's view.

``_members`` and ``_etcd`` (no I/O: values and the JSON gateway's bodies),
``_etcd_client`` (a small etcd v3 client over httpx2), ``_registration`` (an
engine's registration under a lease), ``_membership`` and ``_cluster_view``
(the proxy's view, read then watched). May import ``_core``.
"""
