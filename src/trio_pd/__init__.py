"""trio_pd: move KV caches between prefill and decode engines with trio, ZeroMQ and NIXL.

The public API; the implementation lives in private modules named after what
they do (``_open_connector``, ``_connector``, ``_consumer``, ``_producer``,
``_backend``, ...).
Testing tools are in :mod:`trio_pd.testing`.
"""

from ._auth import CurveAuth, generate_keypair
from ._backend import BackendError, BackendFactory, LoadRequest, RemoteAgent, TransferBackend
from ._config import ConnectorConfig
from ._connector import Connector
from ._engines import EngineState, FailureCause
from ._errors import (
    ExposureEndedError,
    HandshakeError,
    IncompatibleEngineError,
    ParamsRejectedError,
    TransferError,
    TrioPdError,
)
from ._exposures import Released
from ._layout import KVLayout
from ._nixl import NixlBackend
from ._open_connector import open_connector
from ._records import (
    ConnectorStatistics,
    ConsumerStatistics,
    ProducerStatistics,
    PullResult,
    RemoteBlocks,
)

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
