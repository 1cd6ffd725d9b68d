"""Deadlines, limits and NIXL options of a connector, in one frozen record, and
the internal knobs it carries privately (:class:`Tuning`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal

import attrs

from trio_pd._core._remote_engine import Backoff
from trio_pd._curve_keys import CurveAuth

NixlSyncMode = Literal["rw", "strict"]


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _positive(_instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (_is_number(value) and math.isfinite(value) and value > 0):
        raise ValueError(f"{attribute.name} must be a finite number > 0, got {value!r}")


def _at_least_one(_instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


def _non_negative(_instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (_is_number(value) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{attribute.name} must be a finite number >= 0, got {value!r}")


def _non_negative_int(_instance: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0, got {value!r}")


def _fraction(_instance: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not (_is_number(value) and 0 <= value <= 1):
        raise ValueError(f"{attribute.name} must be a number in [0, 1], got {value!r}")


def _optional_secret(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    if value is not None and not (isinstance(value, bytes) and len(value) >= 16):
        raise ValueError(f"{attribute.name} must be None or at least 16 bytes")


def _freeze_backend_params(
    params: Mapping[str, Mapping[str, str]],
) -> Mapping[str, Mapping[str, str]]:
    return MappingProxyType(
        {
            str(name): MappingProxyType({str(k): str(v) for k, v in opts.items()})
            for name, opts in params.items()
        }
    )


@attrs.frozen(kw_only=True)
class Tuning:
    """Internal pacing and sizing knobs of a connector, not part of the public API.

    Each was a :class:`ConnectorConfig` field that no deployment set; they
    stay adjustable for the tests and the benchmarks, which set them through
    :func:`tuned` (a config's ``_tuning``). Names, defaults and meaning may
    change in any release.

    Attributes:
        poll_interval: how long the transfer driver sleeps between checks of
            running transfers when nothing moved for ``poll_spin``. Sleeping
            leaves the core to the threads that drive the same transfers (on
            a small machine, spinning delays the completion it waits for).
            Default 0.0001.
        poll_spin: how long the transfer driver checks running transfers
            without sleeping after something moved. Default 0.0001.
        inline_read_spin: how long the trio thread checks an inline read
            before it hands the still-running transfer to the driver (so a
            read to a far or stalled peer holds the loop no longer than
            this). Default 0.0005.
        max_descriptors_per_transfer: the most descriptors (blocks x regions)
            in one posted NIXL transfer; a larger pull is posted in chunks.
            Default 8192.
        resolved_history: how many resolved exposures are remembered so that
            :meth:`~trio_pd.Connector.wait_released` called after the fact still
            sees the outcome. Default 4096.
        nixl_progress_thread: start NIXL's own progress thread. It polls without
            pause and keeps a whole core busy per agent even when idle
            (measured: 1.0 core for one idle connector), so it is off by
            default: trio_pd's transfer driver and the producer's
            notification thread advance the agent instead. Default False.
    """

    poll_interval: float = attrs.field(default=0.0001, validator=_positive)
    poll_spin: float = attrs.field(default=0.0001, validator=_non_negative)
    inline_read_spin: float = attrs.field(default=0.0005, validator=_non_negative)
    max_descriptors_per_transfer: int = attrs.field(default=8192, validator=_at_least_one)
    resolved_history: int = attrs.field(default=4096, validator=_at_least_one)
    nixl_progress_thread: bool = False


@attrs.frozen(kw_only=True)
class ConnectorConfig:
    """Every deadline, limit and NIXL option of a connector.

    All durations are in seconds. The defaults suit one host or a fast
    network; a deployment across hosts may want a longer ``handshake_timeout``.

    Attributes:
        handshake_timeout: how long one handshake attempt may take from its
            start, all of it together: the wait for a free fetch slot, fetching
            the remote engine's metadata over the side channel, the wait in the
            load queue and loading the remote agent into NIXL. Every pull
            waiting on that engine fails with :class:`~trio_pd.HandshakeError`
            when it passes. Default 5.0 (as vLLM).
        transfer_timeout: how long one pull's transfers may take, counted from
            when they are handed to the transfer driver. Past it the pull
            raises :class:`~trio_pd.TransferError`. Default 30.0.
        abort_timeout: the longest the producer holds exposed blocks, however
            often their lease is renewed; after it the exposure resolves
            :attr:`~trio_pd.Released.EXPIRED` and the blocks may be reused.
            Default 120.0.
        lease_initial: how long an exposure is held before its first
            renewal: it resolves :attr:`~trio_pd.Released.EXPIRED` after
            this unless a consumer renews it (see
            :meth:`~trio_pd.Connector.hold`), reads it, or abandons it.
            Default 30.0.
        lease_renewal: how far each heartbeat of a consumer that holds an
            exposure extends its lease (from the heartbeat's arrival), up to
            ``abort_timeout`` after it was exposed. Default 10.0.
        heartbeat_interval: how often a consumer renews the leases of the
            exposures it holds: one message per producer rank per interval,
            naming all of them. Must be below ``lease_renewal``. Default 3.0.
        close_timeout: how long a transfer that must stop (its pull was
            cancelled or timed out, or the connector is closing) is waited for
            before its handle is released anyway; also bounds the wait at
            shutdown for pulls running in other tasks. Default 5.0.
        interface_timeout: how long :func:`~trio_pd.open_connector` waits, before
            it creates the NIXL agent, for the network interface that holds
            the advertised address to be up (NIXL advertises only the
            interfaces up when the agent is created: an engine started while
            its link was down would stay unreachable for its life). Past it,
            ``open_connector`` raises ``OSError`` naming the interface.
            Loopback, IPv6 and addresses no local interface holds are not
            checked. Default 30.0.
        max_concurrent_fetches: how many metadata fetches (network round trips)
            may be in flight at once, for different engines. ``1`` serialises
            them as vLLM does. (Loading remote agents into NIXL is always
            serialised, in the handshake task.) Default 8.
        max_message_bytes: the largest side-channel message accepted, in either
            direction; larger ones are dropped by ZeroMQ. Default 1 MiB.
        max_bytes_per_transfer: the most bytes in one posted transfer, and
            what the transfer driver posts per turn before it polls and
            takes new pulls. On one host a transfer's bytes are copied while
            it is posted (about 2 ms for the default here), so this bounds
            how long a large pull holds up a small one. Cancellation and
            shutdown stop a pull between its chunks. Default 8 MiB.
        inline_read_bytes: a pull's read of at most this many bytes (one
            transfer) is posted by the trio thread itself, without the
            transfer driver, when nothing else would run: the driver has no
            job, no remote agent is being loaded, and no other task is
            runnable (see ``_inline``). It saves the driver's and the task's
            wake-ups, most of a small pull's time. 0 turns it off. Default
            256 KiB (on one host ``transfer()`` is the copy: its time on the
            trio thread grows with the size).
        notification_poll_interval: while exposures are pending, the
            producer's notification thread checks for consumer notifications;
            each check also advances the NIXL agent, which consumers' READs
            wait for. It checks every 100 us while reads are
            expected (for half a second after blocks are exposed or a
            notification arrives); beyond that -- exposures nobody reads --
            at doubling intervals up to this one, so that stale exposures
            cost little CPU. The first READ of such an exposure may wait up
            to this long, once. Default 0.002.
        idle_notification_poll_interval: how often the producer checks while
            nothing is pending (late notifications are then only logged), and
            the longest the notification thread waits before it hands
            control back to the trio loop (expiry is checked then).
            Default 0.05.
        backoff_initial: after a failed handshake the engine is in backoff:
            pulls fail fast with the same error until the delay passes, then
            the next pull retries. The n-th consecutive failure waits
            ``min(backoff_max, backoff_initial * 2**(n-1))``, shortened by a
            random fraction up to ``backoff_jitter``. Default 1.0.
        backoff_max: the longest backoff delay. Default 30.0.
        backoff_jitter: the largest random fraction a backoff delay is
            shortened by, so that consumers do not retry in step. Default 0.2.
        auth: CURVE authentication of the side channel (see
            :class:`~trio_pd.CurveAuth`); ``None`` (default) for none.
        exposure_secret: a secret shared by the engines of one deployment
            (at least 16 bytes). A producer with one signs every exposure
            (``remote_token`` in ``kv_transfer_params``); a consumer with
            one reads only blocks whose token it can verify, so parameters
            that no producer issued (other block ids, request id, engine,
            address) fail their own request before anything is read.
            ``None`` (default): no tokens are issued or checked. Hidden in
            ``repr``.
        compatibility_key: a string that must be equal on producer and consumer
            (for example the model name and revision). It goes into the
            compatibility hash. Default ``""``.
        nixl_backends: NIXL backends to create. Default ``("UCX",)``.
        nixl_backend_params: per-backend init parameters passed to NIXL's
            ``create_backend``, e.g. ``{"UCX": {"ucx_error_handling_mode": "peer"}}``.
        nixl_sync_mode: the NIXL agent's thread-sync mode. The handshake
            thread, the transfer driver and the notification thread call the
            same agent at once, so ``"none"`` is not offered: ``"rw"``
            (reader/writer lock, the default) or ``"strict"`` (one lock).
        nixl_num_threads: worker threads for multi-threaded backends (0 = backend
            default, the default). For UCX this is NIXL's thread pool: a
            transfer is copied by the pool's threads while the transfer
            driver polls, and trio_pd also passes ``split_batch_size=1``
            (unless ``nixl_backend_params`` sets it) so that every transfer,
            even a chunk NIXL merged into one descriptor, goes to the pool.
            Measured on one host (2 cores, ``docs/performance.md``): with 2
            threads one large pull ran x1.3 faster (median of 15 interleaved
            repetitions; x0.9 to x2.3 between runs) and sequential 1-4 block
            pulls x1.5. Off by default: after a peer failed, UCX left the
            failed READ's request unreturned (in 20 of 28 runs of the
            failure tests) and twice aborted the consumer process (an
            assertion in ``arbiter.c``) when the agent was released; none of
            that in 22 runs without the pool.
    """

    handshake_timeout: float = attrs.field(default=5.0, validator=_positive)
    transfer_timeout: float = attrs.field(default=30.0, validator=_positive)
    abort_timeout: float = attrs.field(default=120.0, validator=_positive)
    lease_initial: float = attrs.field(default=30.0, validator=_positive)
    lease_renewal: float = attrs.field(default=10.0, validator=_positive)
    heartbeat_interval: float = attrs.field(default=3.0, validator=_positive)
    close_timeout: float = attrs.field(default=5.0, validator=_positive)
    interface_timeout: float = attrs.field(default=30.0, validator=_positive)
    max_concurrent_fetches: int = attrs.field(default=8, validator=_at_least_one)
    max_message_bytes: int = attrs.field(default=1 << 20, validator=_at_least_one)
    max_bytes_per_transfer: int = attrs.field(default=8 << 20, validator=_at_least_one)
    inline_read_bytes: int = attrs.field(default=256 << 10, validator=_non_negative_int)
    notification_poll_interval: float = attrs.field(default=0.002, validator=_positive)
    idle_notification_poll_interval: float = attrs.field(default=0.05, validator=_positive)
    backoff_initial: float = attrs.field(default=1.0, validator=_positive)
    backoff_max: float = attrs.field(default=30.0, validator=_positive)
    backoff_jitter: float = attrs.field(default=0.2, validator=_fraction)
    auth: CurveAuth | None = None
    exposure_secret: bytes | None = attrs.field(
        default=None, validator=_optional_secret, repr=False
    )
    compatibility_key: str = ""
    nixl_backends: tuple[str, ...] = attrs.field(default=("UCX",), converter=tuple)
    nixl_backend_params: Mapping[str, Mapping[str, str]] = attrs.field(
        factory=dict, converter=_freeze_backend_params, eq=False
    )
    nixl_sync_mode: NixlSyncMode = attrs.field(
        default="rw", validator=attrs.validators.in_(("rw", "strict"))
    )
    nixl_num_threads: int = attrs.field(default=0, validator=_non_negative_int)
    _tuning: Tuning = attrs.field(factory=Tuning, alias="_tuning")
    """The internal knobs (:class:`Tuning`); see :func:`tuned`."""

    def __attrs_post_init__(self) -> None:
        if self.heartbeat_interval >= self.lease_renewal:
            raise ValueError(
                f"heartbeat_interval ({self.heartbeat_interval:g} s) must be below "
                f"lease_renewal ({self.lease_renewal:g} s), or leases lapse between heartbeats"
            )

    @property
    def backoff(self) -> Backoff:
        return Backoff(self.backoff_initial, self.backoff_max, self.backoff_jitter)


def tuned(config: ConnectorConfig, **changes: Any) -> ConnectorConfig:
    """``config`` with these :class:`Tuning` fields changed (for tests and benchmarks)."""
    return attrs.evolve(config, _tuning=attrs.evolve(config._tuning, **changes))
