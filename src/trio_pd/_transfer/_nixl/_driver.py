"""The transfer driver: one thread that posts, polls and releases every transfer of an agent.

A pull's reads are *jobs*. The trio side builds a :class:`Job`, hands it to
:meth:`TransferDriver.submit` and waits on ``job.finished``; the driver thread
does every NIXL call of the data plane:

* it posts each job's READs in chunks (at most ``max_bytes_per_transfer`` and
  ``max_descriptors_per_transfer`` each), new jobs first and the others
  round robin, up to one chunk's worth of bytes per turn, so a large pull
  cannot hold the thread for more than a chunk while a small one waits (on
  one host a chunk's ``transfer()`` *is* the copy: about 2 ms for 8 MiB here);
* it *batches*: small jobs for the same remote agent that are waiting in the
  same turn go out as one transfer (their indices concatenated) with one
  notification that names every request (see ``_protocol.join_notifications``),
  so a thousand tiny pulls cost a few NIXL calls, not a thousand;
* it polls every running transfer together, which also advances the UCX
  worker, and releases each handle as soon as it ends;
* it sends the notification with the transfer when a job is one chunk, and
  with ``send_notif`` once every chunk is done otherwise (the producer must
  hear of a pull only after all its bytes have been read);
* it wakes tasks in batches: one ``run_sync_soon`` per turn for every job
  that ended in it.

Stopping a job (its task cancelled, ``transfer_timeout`` passed, the backend
closing, or an error in one of its transfers) decides the error it will end
with (see ``_jobs``: ``JobCancelled``, ``TransferTimeout``,
``BackendClosing``, or NIXL's exception as ``_errors`` maps it); no further
chunk is posted, and its running transfers (shared with the other jobs of a
batch) are polled until they end, for at most ``close_timeout``. A transfer
still running then -- its peer is unreachable, and NIXL cannot cancel it
(measured: its bytes land once the link is back, even after the handle is
released and the agent removed) -- is *not* released: the job finishes with
``still_running`` set and the error that says so (``_jobs.unstoppable``),
the driver keeps polling that transfer (every :data:`LINGER_POLL` s when
nothing else runs) until it really ends, and only then releases it and sets
``job.settled``. Until then the job's local blocks may still be
written; ``settled`` is what tells the caller they are safe to reuse.

Threads: the driver thread touches NIXL, its jobs' driver-side fields and
its own lists. The trio side writes only ``cancel_requested`` (a flag the
driver reads) and ``on_settled``; ``finished`` and ``settled`` are trio
Events set on the trio thread (through the trio token), so a task wakes
only after the driver has written how the job ended (``job.error``: the
exception the task raises, ``None`` if it ended well). NIXL's exceptions
are mapped where they are caught (``_errors.nixl_error``) and never kept:
the job holds the mapped error alone.

Ownership: the driver owns every transfer handle from posting to release.
The one exception is a small READ the trio thread posts itself while the
driver is idle (:attr:`TransferDriver.idle`; see ``_inline``): the trio
thread owns it until it is released there or *adopted* by the driver
(:meth:`TransferDriver.adopt`), after which the driver owns it as if it had
posted it.
:meth:`TransferDriver.stop` ends the thread; transfers still running then
are *not* released and their jobs stay unsettled (``transfers_kept`` says
how many): the backend then keeps its agent and memory registered rather
than free memory a transfer may still write.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import trio

from trio_pd._config import ConnectorConfig
from trio_pd._core._protocol import join_notifications
from trio_pd._transfer._backend import BackendClosing, BackendError, TransferTimeout
from trio_pd._transfer._nixl._errors import describe, nixl_call, nixl_error, release_or_keep
from trio_pd._transfer._nixl._jobs import Job, JobCancelled, stop_reason, unstoppable, wake
from trio_pd._transfer._nixl._posting import plan_turn
from trio_pd._transfer._nixl._timer_slack import fine_timer_slack

logger = logging.getLogger("trio_pd.nixl")

LINGER_POLL = 0.01
"""How often a transfer that could not be stopped is checked while nothing
else runs (it waits for a partition to heal: no need to spin)."""


@attrs.define(eq=False)
class _Transfer:
    """A posted NIXL transfer and the jobs whose descriptors it reads."""

    handle: Any
    jobs: list[Job]


class TransferDriver:
    """The thread that owns every transfer handle of one NIXL agent.

    Create it on the trio thread, :meth:`start` it, :meth:`submit` jobs,
    :meth:`stop` it before the agent is released.
    """

    def __init__(self, agent: Any, agent_name: str, config: ConnectorConfig) -> None:
        self._agent = agent
        self._config = config
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._closing = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"trio_pd transfers of {agent_name}", daemon=True
        )
        self._token: trio.lowlevel.TrioToken | None = None
        self.transfers_posted = 0  # (written by the thread; read anywhere)
        self.transfers_kept = 0  # still running at stop (written by the thread before it ends)
        self._crash: str | None = None  # what the thread crashed with (set once)
        self._ended = False  # set (once) when the thread stopped as asked
        self._unsettled_jobs = 0  # (trio thread only) submitted, not yet settled
        # Driver thread only:
        self._jobs: collections.deque[Job] = collections.deque()  # not finished
        self._transfers: list[_Transfer] = []  # running (some only for finished jobs)
        self._stuck: list[Any] = []  # handles NIXL refused to release
        self._kept: list[Any] = []  # adopted once the thread had stopped: never released
        self._to_finish: list[Job] = []
        self._to_settle: list[Job] = []

    def start(self) -> None:
        """Start the thread (on the trio thread: it wakes tasks through its token)."""
        self._token = trio.lowlevel.current_trio_token()
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Hand ``job`` to the thread (never blocks).

        If the thread has crashed (a bug), the job fails at once instead; if
        it has stopped, the job ends with ``BackendClosing`` at once.
        """
        job.submitted_at = job.submitted_at or time.monotonic()  # (adopted: when posted)
        job.finished, job.settled = trio.Event(), trio.Event()
        self._unsettled_jobs += 1
        self._inbox.put(job)
        if self._crash is not None or self._ended:  # (nobody else will answer it: do it here)
            for queued in self._drain_inbox():
                queued.ended = True
                if self._keep_adopted(queued):
                    queued.finished.set()
                    continue
                queued.error = self._crashed() if self._crash is not None else BackendClosing()
                queued.finished.set()
                queued.settled.set()

    @property
    def idle(self) -> bool:
        """Whether every job given to the thread has settled (trio thread only).

        The thread then makes no NIXL call: it waits on its queue (transfers
        outlive their jobs only when they could not be stopped, and those
        jobs are not settled), and only the trio thread can give it work.
        ``_inline`` relies on this to post a READ itself in the meantime.
        """
        return (
            self._unsettled_jobs == 0
            and not self._closing.is_set()
            and self._crash is None
            and not self._ended
        )

    def adopt(self, job: Job, handle: Any) -> None:
        """Take ``job``, whose one transfer the trio thread posted and which
        still runs (see ``_inline``): from now on the thread owns ``handle``
        and finishes ``job`` as if it had posted it.

        A driver that has stopped (or crashed) cannot poll it: the job then
        ends at once, as one that could not be stopped (``still_running``,
        its ``settled`` never set), and the handle is kept, never released
        (:attr:`transfers_kept` counts it): its READ may still write.
        """
        job.adopted, job.running = handle, 1
        self.submit(job)

    def begin_close(self) -> None:
        """Stop every job (``BackendClosing``) at the thread's next turn."""
        self._closing.set()

    async def stop(self) -> None:
        """Stop every job, end the thread and wait for it (within ``close_timeout``)."""
        self._closing.set()
        self._inbox.put(None)
        if self._thread.is_alive():
            await trio.to_thread.run_sync(self._thread.join)
        else:
            await trio.lowlevel.checkpoint()
        self._agent = None  # (the agent is released once nothing refers to it)

    # ---- the thread -----------------------------------------------------

    def _run(self) -> None:
        fine_timer_slack()  # (its poll_interval sleeps end on time)
        try:
            self._loop()
            self._ended = True  # (from now on, submit() answers new jobs itself)
            for job in self._drain_inbox():  # submitted during the last turn
                job.ended = True
                self._to_finish.append(job)
                if not self._keep_adopted(job):
                    job.error = BackendClosing()
                    self._to_settle.append(job)
            self._deliver()
        # A bug (whatever it raises: this is a plain thread, trio.Cancelled
        # cannot reach it): fail every job rather than hang its task.
        except BaseException as exc:  # noqa: ASYNC103
            logger.critical("transfer driver crashed: %s", describe(exc), exc_info=True)
            self._crash = describe(exc)  # (from now on, submit() fails new jobs itself)
            jobs = {id(job): job for job in self._jobs}
            for transfer in self._transfers:
                jobs.update((id(job), job) for job in transfer.jobs)
            jobs.update((id(job), job) for job in self._drain_inbox())
            for job in jobs.values():
                if not job.ended:
                    job.ended, job.error = True, self._crashed()
                    self._to_finish.append(job)
                self._to_settle.append(job)
            self._deliver()

    def _keep_adopted(self, job: Job) -> bool:
        """A job adopted after the thread stopped: keep its running transfer
        (see :meth:`adopt`); whether it had one. (Once the thread has ended,
        or in its last act.)"""
        if job.adopted is None:
            return False
        self._kept.append(job.adopted)
        job.adopted = None
        job.still_running = True
        job.error = unstoppable(job, "closing", 0.0)
        self.transfers_kept += 1
        return True

    def _crashed(self) -> BackendError:
        """A job's error once the thread crashed (a fresh one for each job)."""
        return BackendError(f"the transfer driver crashed: {self._crash}")

    def _drain_inbox(self) -> list[Job]:
        jobs: list[Job] = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return jobs
            if item is not None:
                jobs.append(item)

    def _loop(self) -> None:
        stopping = False
        idle_since = time.monotonic()
        while True:
            if not self._jobs and not stopping:
                stopping = self._take(block=True)
            stopping = self._take(block=False) or stopping
            if stopping:
                self._closing.set()
                if not self._jobs:
                    self._release_all()
                    self._deliver()
                    return
            if self._turn(time.monotonic()):
                idle_since = time.monotonic()
            elif time.monotonic() - idle_since >= self._config._tuning.poll_spin:
                time.sleep(self._config._tuning.poll_interval)

    def _take(self, *, block: bool) -> bool:
        """Move submitted jobs to the front of the run queue; return True on stop.

        Blocking waits for the first submission, polling transfers that
        outlived their jobs every :data:`LINGER_POLL` s meanwhile.
        """
        try:
            if block:
                while True:
                    try:
                        timeout = LINGER_POLL if self._transfers else None
                        item = self._inbox.get(timeout=timeout)
                        break
                    except queue.Empty:
                        self._poll_transfers()
                        self._deliver()
            else:
                item = self._inbox.get_nowait()
        except queue.Empty:
            return False
        stop = False
        new: list[Job] = []
        while True:
            if item is None:
                stop = True
            else:
                new.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
        for job in new:
            if job.adopted is not None:
                self._transfers.append(_Transfer(job.adopted, [job]))
                job.adopted = None
        self._jobs.extendleft(reversed(new))
        return stop

    def _turn(self, now: float) -> bool:
        """One turn: stop checks, posts, polls, wake-ups. Return whether anything moved."""
        jobs = self._jobs
        for job in jobs:
            self._check_stop(job, now)
        moved = self._post()
        moved = self._poll_transfers() or moved
        now = time.monotonic()
        finished = False
        for job in jobs:
            moved = self._finish_if_over(job, now) or moved
            finished = finished or job.ended
        if finished:
            self._jobs = collections.deque(job for job in jobs if not job.ended)
        self._deliver()
        return moved

    # ---- posting --------------------------------------------------------

    def _post(self) -> bool:
        """Post what :func:`~trio_pd._transfer._nixl._posting.plan_turn` plans; return
        whether anything was."""
        posts = plan_turn(self._jobs, self._config.max_bytes_per_transfer)
        for post in posts:
            if post.kind == "notify":
                self._notify(post.jobs[0])
            elif post.kind == "batch":
                self._post_batch(post.jobs)
            else:
                job = post.jobs[0]
                self._start(
                    [job],
                    job.local_indices[post.start : post.stop],
                    job.remote_indices[post.start : post.stop],
                    b"",
                )
        return bool(posts)

    def _post_batch(self, batch: list[Job]) -> None:
        """Post whole jobs (same remote agent) as one transfer with one notification."""
        if len(batch) == 1:
            first = batch[0]
            local, remote = first.local_indices, first.remote_indices
        else:
            local = np.concatenate([job.local_indices for job in batch])
            remote = np.concatenate([job.remote_indices for job in batch])
        notification = join_notifications([job.notification for job in batch])
        self._start(batch, local, remote, notification)

    def _start(
        self,
        jobs: list[Job],
        local: npt.NDArray[np.int32],
        remote: npt.NDArray[np.int32],
        notification: bytes,
    ) -> None:
        """Make and post one READ for ``jobs``; track it if it runs on."""
        first = jobs[0]
        now = time.monotonic()
        for job in jobs:
            job.posted_at = job.posted_at or now
        try:
            handle = self._agent.make_prepped_xfer(
                "READ", first.local_dlist, local, first.remote_dlist, remote, notification
            )
        except Exception as exc:
            self._fail(jobs, functools.partial(nixl_error, "make_prepped_xfer", exc))
            return
        self.transfers_posted += 1
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            self._release(handle)
            self._fail(jobs, functools.partial(nixl_error, "transfer", exc))
            return
        if state == "PROC":
            for job in jobs:
                job.running += 1
            self._transfers.append(_Transfer(handle, jobs))
        else:
            self._release(handle)
            if state != "DONE":
                self._fail(jobs, functools.partial(BackendError, f"transfer state {state}"))

    def _notify(self, job: Job) -> None:
        job.posted_at = job.posted_at or time.monotonic()
        try:
            self._agent.send_notif(job.agent_name, job.notification)
        except Exception as exc:
            self._fail([job], functools.partial(nixl_error, "send_notif", exc))

    # ---- polling and finishing ------------------------------------------

    def _poll_transfers(self) -> bool:
        """Check every running transfer; release the ended ones. Return whether any ended."""
        if not self._transfers:
            return False
        still = []
        for transfer in self._transfers:
            try:
                state = self._agent.check_xfer_state(transfer.handle)
            except Exception as exc:
                self._fail(transfer.jobs, functools.partial(nixl_error, "check_xfer_state", exc))
                state = "ERR"
            if state == "PROC":
                still.append(transfer)
                continue
            self._release(transfer.handle)
            if state != "DONE":
                self._fail(
                    transfer.jobs, functools.partial(BackendError, f"transfer state {state}")
                )
            for job in transfer.jobs:
                job.running -= 1
                if job.still_running and job.running == 0:
                    self._to_settle.append(job)  # its last transfer really ended
        ended = len(still) < len(self._transfers)
        self._transfers = still
        return ended

    def _finish_if_over(self, job: Job, now: float) -> bool:
        """Finish ``job`` if nothing of it runs or remains to post (or abandon it
        if it is past its stop deadline); return whether it was finished."""
        if job.running:
            if job.stopping is not None and now >= job.stop_by:
                self._abandon(job)
                return True
            return False
        if job.stopping is None:
            if job.posted == -1 or (job.posted == job.size > job.chunk):
                if job.size > job.chunk:
                    self._notify(job)  # every chunk is done: the producer may hear of it
            elif job.posted != job.size or job.size == 0:
                return False  # chunks still to post
        self._finish(job)
        return True

    def _check_stop(self, job: Job, now: float) -> None:
        if job.stopping is not None:
            return
        error: Exception
        if job.cancel_requested:
            error = JobCancelled()
        elif self._closing.is_set():
            error = BackendClosing()
        elif now >= job.deadline:
            error = TransferTimeout()
        else:
            return
        job.stopping, job.stop_by = error, now + self._config.close_timeout

    def _fail(self, jobs: list[Job], error: Callable[[], BackendError]) -> None:
        """Stop ``jobs`` (those not stopping already), each to end with a fresh
        ``error()``: the tasks of a batch's jobs each raise their own."""
        stop_by = time.monotonic() + self._config.close_timeout
        for job in jobs:
            if job.stopping is None:
                job.stopping = error()
                job.stop_by = stop_by

    def _abandon(self, job: Job) -> None:
        """Finish ``job`` now, with the error that says a transfer still runs;
        its transfers stay polled until they really end."""
        assert job.stopping is not None
        reason = stop_reason(job.stopping)
        logger.error(
            "%d transfers from agent %s still run %g s after being told to stop (%s); "
            "polling them until they end: their blocks are not settled until then",
            job.running,
            job.agent_name,
            self._config.close_timeout,
            reason,
        )
        job.still_running = True
        job.stopping = unstoppable(job, reason, self._config.close_timeout)
        self._finish(job)

    def _finish(self, job: Job) -> None:
        """``job`` is over: it ends with the error it was stopped with (``None``: well)."""
        job.ended, job.error = True, job.stopping
        job.finished_at = time.monotonic()
        job.local_dlist = job.remote_dlist = None  # (they keep the agent alive)
        self._to_finish.append(job)
        if not job.still_running:
            self._to_settle.append(job)

    def _release_all(self) -> None:
        """At stop: release every handle, except those of transfers still running.

        Those are kept, with their jobs unsettled: releasing a handle does
        not stop a transfer NIXL cannot stop, so its bytes would land in
        memory the caller believes free. :attr:`transfers_kept` tells the
        backend to keep its memory registered.
        """
        self._poll_transfers()
        if self._transfers:
            self.transfers_kept = len(self._transfers)
            logger.error(
                "%d transfers still ran when the connector closed (peer unreachable?): "
                "kept, with their local memory registered, for the life of the process",
                len(self._transfers),
            )
        for handle in self._stuck:
            try:
                nixl_call("release", handle.release)
            except BackendError as exc:
                logger.warning("a stuck transfer handle could not be released: %s", exc.nixl_error)
        self._stuck.clear()

    def _release(self, handle: Any) -> None:
        release_or_keep(handle, self._stuck)

    def _deliver(self) -> None:
        """Wake the tasks of the jobs that finished or settled since the last call."""
        if not self._to_finish and not self._to_settle:
            return
        finished, self._to_finish = self._to_finish, []
        settled, self._to_settle = self._to_settle, []
        assert self._token is not None
        with contextlib.suppress(trio.RunFinishedError):  # (the run ended: nobody waits)
            self._token.run_sync_soon(self._wake, finished, settled)

    def _wake(self, finished: list[Job], settled: list[Job]) -> None:
        """On the trio thread: wake the jobs' tasks; count the settled ones."""
        self._unsettled_jobs -= len(settled)
        wake(finished, settled)
