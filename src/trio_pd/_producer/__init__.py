"""The producer (prefill) role: exposures, the side-channel listener, notifications.

``_producer`` (:class:`Producer`) owns the listener (it answers the
metadata, lease and confirmation requests the side channel's ``serve``
hands it -- ZeroMQ: a ROUTER socket -- with the decisions of
``_core._listener_rules``), the exposures (``_core._exposures``) and the
notification task that counts reads and expires exposures. May import
``_core``, ``_side_channel`` and ``_transfer``.
"""
