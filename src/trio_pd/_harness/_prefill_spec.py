"""What a prefill worker process builds, and how its configuration travels there.

:class:`WorkerSpec` is the whole of what the parent (``_prefill_worker``)
tells the child (``_prefill_child``): it goes to the child as JSON on its
command line. A :class:`~trio_pd.ConnectorConfig` goes inside it as JSON-able
keyword arguments (:func:`config_overrides`, read back by
:func:`config_from_overrides`); :func:`jsonable` encodes the few values JSON
does not know (in the config and in the child's replies). No I/O.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from trio_pd._config import ConnectorConfig, Tuning
from trio_pd._curve_keys import CurveAuth


def _shape(values: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in values)


@attrs.frozen
class WorkerSpec:
    """What the child process builds: its engines and their KV cache shape.

    Each engine has ``regions`` tensors of shape ``(blocks, *block_shape)``
    and ``dtype``, and its own connector (NIXL agent, side channel). With
    ``engines == 1`` the engine is called ``engine_id``; with more, they are
    ``engine_id-0``, ``engine_id-1``, ... (one process can host many cheap
    engines for benchmarks). ``port`` applies to a single engine only.

    ``tp_rank``/``tp_size`` make the (single) engine one rank of a
    tensor-parallel engine (``port`` is then its base port, and must be
    given); ``payload`` says how ``expose`` fills blocks: ``"blocks"``
    (:func:`fill_blocks`) or ``"heads"`` (:func:`fill_heads`, for TP).
    ``advertise_host`` is passed to :func:`~trio_pd.open_connector`.

    ``netns`` runs the process in that network namespace (a test host, see
    :func:`open_test_hosts`); ``env`` adds environment variables (for
    example ``{"UCX_TLS": "tcp"}``).
    """

    engine_id: str
    engines: int = 1
    regions: int = 4
    blocks: int = 64
    block_shape: tuple[int, ...] = attrs.field(default=(16, 128), converter=_shape)
    dtype: str = "float16"
    host: str = "127.0.0.1"
    port: int = 0
    config: Mapping[str, Any] = attrs.field(factory=dict)
    tp_rank: int = 0
    tp_size: int = 1
    payload: str = attrs.field(
        default="blocks", validator=attrs.validators.in_(("blocks", "heads"))
    )
    advertise_host: str | None = None
    netns: str = ""
    env: Mapping[str, str] = attrs.field(factory=dict)

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self))

    @property
    def engine_ids(self) -> list[str]:
        if self.engines == 1:
            return [self.engine_id]
        return [f"{self.engine_id}-{i}" for i in range(self.engines)]


def jsonable(value: object) -> object:
    """``json.dumps``'s ``default``: ``value`` as JSON knows it (mappings, sets
    and tuples, ``CurveAuth`` and ``Tuning``, bytes as hex).

    Raises:
        TypeError: anything else.
    """
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, frozenset | set | tuple):
        return sorted(value) if isinstance(value, frozenset | set) else list(value)
    if isinstance(value, CurveAuth | Tuning):
        return attrs.asdict(value, recurse=False)
    if isinstance(value, bytes):  # exposure_secret: hex (see config_from_overrides)
        return value.hex()
    raise TypeError(f"{type(value).__name__} is not JSON-able")


def config_overrides(config: ConnectorConfig) -> dict[str, Any]:
    """``config`` as JSON-able keyword arguments of :class:`ConnectorConfig`.

    An ``exposure_secret`` travels as hex (in the worker's command line: a
    test tool's secret, not a deployment's).
    """
    loaded: dict[str, Any] = json.loads(
        json.dumps(attrs.asdict(config, recurse=False), default=jsonable)
    )
    return loaded


def config_from_overrides(overrides: Mapping[str, Any]) -> ConnectorConfig:
    """The :class:`ConnectorConfig` that :func:`config_overrides` encoded."""
    values = dict(overrides)
    if values.get("auth") is not None:
        values["auth"] = CurveAuth(**values["auth"])
    if values.get("_tuning") is not None:
        values["_tuning"] = Tuning(**values["_tuning"])
    if isinstance(values.get("exposure_secret"), str):
        values["exposure_secret"] = bytes.fromhex(values["exposure_secret"])
    return ConnectorConfig(**values)
