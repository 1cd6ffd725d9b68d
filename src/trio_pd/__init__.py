"""trio_pd: move KV caches between prefill and decode engines with trio, ZeroMQ and NIXL.

The public API; the implementation lives in private modules named after what
they do (``_connector``, ``_protocol``, ``_engines``, ...).
"""

from ._auth import CurveAuth, generate_keypair
from ._config import ConnectorConfig
from ._connector import Connector, open_connector
from ._engines import EngineState
from ._errors import (
    HandshakeError,
    IncompatibleEngineError,
    TransferError,
    TrioPdError,
)
from ._exposures import Released
from ._layout import KVLayout
from ._records import ConnectorStatistics, PullResult, RemoteBlocks

__version__ = "0.1.0"

__all__ = [
    "Connector",
    "ConnectorConfig",
    "ConnectorStatistics",
    "CurveAuth",
    "EngineState",
    "HandshakeError",
    "IncompatibleEngineError",
    "KVLayout",
    "PullResult",
    "Released",
    "RemoteBlocks",
    "TransferError",
    "TrioPdError",
    "generate_keypair",
    "open_connector",
]
