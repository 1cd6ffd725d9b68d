"""trio_pd: move KV caches between prefill and decode engines with trio, ZeroMQ and NIXL.

The public API; the implementation lives in private packages named after
what they hold: ``_core`` (sans-IO: protocol, state machines, decisions),
``_side_channel`` (ZeroMQ), ``_transfer`` (the backend seam and NIXL),
``_consumer`` and ``_producer`` (the two roles), ``_membership`` (etcd),
``_serve`` and ``_cli`` (the commands; ``__main__`` runs the latter),
``_harness`` (what the demo and the tests run around the library).
``open_connector`` and the :class:`Connector` facade are in ``_connector``;
what every layer reads is beside it: ``_config`` (:class:`ConnectorConfig`),
``_curve_keys`` (:class:`CurveAuth`), ``_exception_groups`` (one clear
exception from a nursery's group) and ``_loggers`` (every logger and what it
logs). Testing tools are in ``testing`` (:mod:`trio_pd.testing`);
``exercises`` checks a learner's code for the documentation's exercises
(``python -m trio_pd.exercises check NAME``).
"""

from trio_pd._config import ConnectorConfig
from trio_pd._connector import Connector, open_connector
from trio_pd._core._errors import (
    ExposureEndedError,
    HandshakeError,
    IncompatibleEngineError,
    ParamsRejectedError,
    TransferError,
    TrioPdError,
)
from trio_pd._core._exposures import Released
from trio_pd._core._layout import KVLayout
from trio_pd._core._public_values import (
    ConnectorStatistics,
    ConsumerStatistics,
    ProducerStatistics,
    PullResult,
    RemoteBlocks,
)
from trio_pd._core._remote_engine import EngineState, FailureCause
from trio_pd._curve_keys import CurveAuth, generate_keypair
from trio_pd._transfer._backend import (
    BackendError,
    BackendFactory,
    LoadRequest,
    RemoteAgent,
    TransferBackend,
)
from trio_pd._transfer._nixl._backend import NixlBackend

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "BackendFactory",
    "Connector",
    "ConnectorConfig",
    "ConnectorStatistics",
    "ConsumerStatistics",
    "CurveAuth",
    "EngineState",
    "ExposureEndedError",
    "FailureCause",
    "HandshakeError",
    "IncompatibleEngineError",
    "KVLayout",
    "LoadRequest",
    "NixlBackend",
    "ParamsRejectedError",
    "ProducerStatistics",
    "PullResult",
    "Released",
    "RemoteAgent",
    "RemoteBlocks",
    "TransferBackend",
    "TransferError",
    "TrioPdError",
    "generate_keypair",
    "open_connector",
]
