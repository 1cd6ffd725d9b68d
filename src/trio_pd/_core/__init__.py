"""The sans-IO core: what trio_pd decides, with no I/O.

The wire protocol (``_protocol``), the remote engine's state machine and the
whole pull policy (``_remote_engine``), the producer's exposures, leases, pins and
confirmations (``_exposures``), the side-channel listener's decisions
(``_listener_rules``), KV layouts and descriptor maths (``_layout``), tensor
parallelism (``_tensor_parallel``), exposure tokens (``_tokens``), the public records
(``_public_values``) and errors (``_errors``). Every rule is a function of the
values it is given (``now`` included). May import only the standard
library, numpy, attrs and msgspec -- never zmq or nixl, and trio only for
the types of public records; the shells around it are the other packages.
"""
