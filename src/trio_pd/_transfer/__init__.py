"""The data plane: the transfer-backend seam and its NIXL implementation.

``_backend`` is the seam: the protocol every backend implements
(:class:`~trio_pd.TransferBackend`), its errors, remote agents and their
leases. ``_nixl`` is the NIXL backend (its own package). The in-memory
backend of the tests is ``trio_pd.testing.MemoryBackend``. May import
``_core``.
"""
