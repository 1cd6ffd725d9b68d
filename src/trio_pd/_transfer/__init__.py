"""The data plane: the transfer-backend seam and its NIXL implementation.

``_backend`` is the seam (the protocol every backend implements, its errors,
remote agents and their leases); the NIXL backend is ``_nixl`` (facade),
``_nixl_agent`` (the local agent), ``_nixl_remotes`` (remote-agent loads and
unloads), ``_nixl_notifications`` (the producer's polls), ``_nixl_errors``
(the one table from NIXL's errors), ``_driver`` and ``_jobs`` (the transfer
driver thread and its jobs), ``_posting`` (what the driver posts in one turn,
no I/O), ``_inline`` (inline reads), ``_timer_slack`` and ``_interfaces``
(waiting for the advertised interface before an agent is created). Owns
NIXL handles, agents and threads; releases them at close, except what a
transfer NIXL could not stop still uses. May import ``_core``.
"""
