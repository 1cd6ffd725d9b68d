"""The NIXL transfer backend: one engine's NIXL agent, its reads and its threads.

``_backend`` is :class:`~trio_pd.NixlBackend`, the facade that implements
the seam (``trio_pd._transfer._backend``); ``_agent`` creates the local agent
and registers the KV cache; ``_remotes`` loads and unloads remote agents
(in a worker thread, with a deadline, retired agents kept until their
transfers end); ``_notifications`` polls the producer's notifications;
``_errors`` is the one table from NIXL's exceptions to the seam's
:class:`~trio_pd._transfer._backend.BackendError`; ``_driver`` and ``_jobs``
are the transfer driver thread and the jobs it posts and polls;
``_posting`` decides what the driver posts in one turn (no I/O);
``_inline`` runs small reads in the pulling task's own thread;
``_interfaces`` waits for the advertised interface before an agent is
created; ``_timer_slack`` sets the driver thread's timer slack.

Owns the NIXL agent, its handles and the driver thread; releases them at
close, except what a transfer NIXL could not stop still uses. May import
``_core`` and the seam; nothing above it.
"""
