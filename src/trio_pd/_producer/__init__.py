"""The producer (prefill) role: exposures, the side-channel listener, notifications.

May import ``_core``, ``_side_channel`` and ``_transfer``.
"""
