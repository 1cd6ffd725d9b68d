"""The consumer (decode) role: pulls, handshakes, holds.

``_pulls`` (:class:`Consumer`) runs a pull's parts; ``_handshakes`` carries
out the remote engines' records (the handshake task, loads); ``_fetch_queue``
the fetch queue, its workers and the deadline watchdog; ``_remote_table`` the
table of remote engine ranks and each one's attempt event; ``_counters``
what they count; ``_leases`` the holds and the heartbeat task;
``_settlement`` which local blocks a transfer that could not be stopped may
still write, and which confirmed READs stopped (their abandon names them, to
end their pins). May import ``_core``, ``_side_channel`` and ``_transfer``.
"""
