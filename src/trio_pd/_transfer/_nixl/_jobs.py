"""A pull's reads as the transfer driver sees them: jobs and how they end.

A :class:`Job` is built on the trio thread, handed to
:meth:`~trio_pd._transfer._nixl._driver.TransferDriver.submit`, and then written by the
driver thread only, except the two fields the trio side may set
(``cancel_requested``, ``on_settled``). Its ``finished`` and ``settled``
events are made when it is handed to the driver (a job that an inline read
ends on the trio thread never needs them) and set on the trio thread by
:func:`wake`, which the driver schedules through the trio token, so a task
wakes only after the driver has written how the job ended.

How it ended is one field, ``Job.error``: ``None`` when it ended well,
otherwise the very exception its waiting task raises -- the
:class:`BackendError` NIXL's exception was mapped to (``_errors``), the
one that says a transfer could not be stopped (:func:`unstoppable`),
:class:`TransferTimeout` or :class:`BackendClosing`. The driver (or an
inline read) makes a fresh one for each job: an exception object is raised
by one task only. A job stopped because its task was cancelled stores
:class:`JobCancelled`, which nobody raises: that task re-raises
``trio.Cancelled``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from trio_pd._config import ConnectorConfig
from trio_pd._transfer._backend import BackendClosing, BackendError, RemoteAgent, TransferTimeout


class JobCancelled(Exception):
    """What a job stores when it stopped because its task was cancelled.

    Never raised: the cancelled task re-raises ``trio.Cancelled``.
    """


def stop_reason(error: BaseException) -> str:
    """Why a job that did not end well was stopped, in words (logs, messages)."""
    if isinstance(error, JobCancelled):
        return "cancelled"
    if isinstance(error, TransferTimeout):
        return "timed out"
    if isinstance(error, BackendClosing):
        return "closing"
    return "failed"


@attrs.define(eq=False)
class Job:
    """One read of a pull's part (or, with no indices, one notification).

    Built on the trio thread and handed to :meth:`TransferDriver.submit`.
    The trio side may set ``cancel_requested`` and ``on_settled``; the driver
    writes the rest and sets ``finished`` (then ``settled``) on the trio thread.

    Attributes:
        local_dlist, remote_dlist: prepared descriptor lists (cleared when finished).
        local_indices, remote_indices: descriptor indices to read.
        agent_name: the remote agent (the notification's destination).
        notification: delivered to the remote once everything is read.
        deadline: ``time.monotonic()`` by which the job must be done.
        chunk: descriptors per posted transfer.
        descriptor_bytes: bytes per descriptor (at most).
        ended: the driver (or an inline read) finished it: ``error`` is final
            (set before ``finished``).
        error: how it ended: ``None`` if well, else the exception its task
            raises (see the module docstring).
        still_running: it finished with transfers NIXL could not stop
            (``error`` is :func:`unstoppable`'s); ``settled`` is set once
            they really ended.
        on_settled: called on the trio thread right after ``settled`` is set.
        finished, settled: set when the driver finished the job, and once its
            transfers really ended; made by :meth:`TransferDriver.submit`
            (there is no such attribute before).
    """

    local_dlist: Any
    remote_dlist: Any
    local_indices: npt.NDArray[np.int32]
    remote_indices: npt.NDArray[np.int32]
    agent_name: str
    notification: bytes
    deadline: float
    chunk: int
    descriptor_bytes: int
    finished: trio.Event = attrs.field(init=False)
    settled: trio.Event = attrs.field(init=False)
    cancel_requested: bool = False
    ended: bool = False
    error: BaseException | None = None
    still_running: bool = False
    on_settled: Callable[[], None] | None = None
    # When (``time.monotonic()``): handed to the driver, first posted, finished
    # by the driver, and its task woken (for measurements: see job_observer).
    submitted_at: float = 0.0
    posted_at: float = 0.0
    finished_at: float = 0.0
    woken_at: float = 0.0
    # A transfer the trio thread posted itself and handed over still running
    # (see ``_inline``): the driver takes it as its own when it takes the job.
    adopted: Any = None
    # The driver's own bookkeeping.
    posted: int = 0  # descriptors posted (-1: a notify-only job, sent)
    running: int = 0  # its transfers still running
    stopping: BaseException | None = None  # told to stop: the error it will end with
    stop_by: float = 0.0

    @property
    def size(self) -> int:
        return len(self.local_indices)


def wake(finished: list[Job], settled: list[Job]) -> None:
    """On the trio thread: set the jobs' events (in this order)."""
    for job in finished:
        job.finished.set()
    for job in settled:
        job.settled.set()
        if job.on_settled is not None:
            job.on_settled()


def job_for(
    remote: RemoteAgent,
    local_indices: npt.NDArray[np.int32],
    remote_indices: npt.NDArray[np.int32],
    notification: bytes,
    config: ConnectorConfig,
) -> Job:
    """The job that reads ``remote_indices`` of ``remote`` into ``local_indices``
    (none: a notification alone), chunked by the config's transfer limits, due
    ``transfer_timeout`` from now."""
    descriptor_bytes = max(remote.local_layout.block_lens)
    chunk = max(
        1,
        min(
            config._tuning.max_descriptors_per_transfer,
            config.max_bytes_per_transfer // descriptor_bytes,
        ),
    )
    return Job(
        remote.local_handle,
        remote.handle,
        local_indices,
        remote_indices,
        remote.agent_name,
        notification,
        time.monotonic() + config.transfer_timeout,
        chunk,
        descriptor_bytes,
    )


def unstoppable(job: Job, reason: str, close_timeout: float) -> BackendError:
    """The error of ``job``, stopped (``reason``, see :func:`stop_reason`)
    with a transfer still running ``close_timeout`` s later: its peer is
    unreachable, and NIXL cannot cancel it. ``peer_lost`` is set (the backend
    gives the agent up), and ``settled`` is the job's own event."""
    return BackendError(
        f"a transfer from {job.agent_name!r} did not stop within "
        f"{close_timeout:g} s of being told to ({reason}; "
        "its peer is unreachable?); the agent was given up, but NIXL cannot "
        "cancel the transfer: its blocks may still be written until it ends "
        "(see TransferError.settled)",
        peer_lost=True,
        settled=job.settled,
    )
