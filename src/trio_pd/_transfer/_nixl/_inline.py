"""Inline reads: one small READ posted and finished on the trio thread when all else is idle.

The transfer driver owns the data plane (see ``_driver``): a pull hands it a
job, the driver's thread wakes up to post it, and the pull's task wakes up
when it ends. For one small READ those two wake-ups are most of the pull:
measured here, a READ of a few 4 KiB blocks with its notification takes
about 0.15 ms in NIXL, and each wake-up 0.07-0.11 ms more. So when the
loop has nothing else to do, the trio thread does that READ itself.

When (:meth:`InlineReads.read`; every condition is checked on the trio
thread with no checkpoint between the check and the NIXL calls):

* the job is one transfer (``size <= chunk``) of at most
  ``config.inline_read_bytes``: on one host ``transfer()`` *is* the copy, so
  its time on the trio thread is bounded by that size;
* the READ is not the first from its remote agent (the backend submits
  that one: it finishes UCX's connection set-up, several times a small
  READ's CPU; see ``RemoteAgent.posted``);
* the driver is idle (:attr:`TransferDriver.idle`): every job it was given
  has settled, so its thread makes no NIXL call (it waits on its queue) and
  gets no job until the trio thread submits one -- which it cannot do while
  it runs this code. One thread at a time posts, polls and releases, as
  before: the driver's thread or, for this one READ, the trio thread;
* no remote-agent load or unload runs in a worker thread, and none is stuck
  (``idle_loads``): they hold NIXL's writer lock, and the trio thread must
  never wait behind one (trio keeps the limiter of an abandoned thread
  borrowed until the thread returns);
* the notification thread is not in a NIXL call: its ``get_new_notifs``
  takes the writer lock too (on the same agent: every connector is also a
  producer). It holds ``other_calls`` around each call; the read takes that
  lock without waiting, or does not run, and holds it while it posts and
  while it checks (not across a schedule point between: a poll may run on
  the trio thread itself), so a poll waits for it instead (at most one
  small copy, or the spin);
* no other task is runnable (trio's run queue is empty, see
  :func:`no_task_runnable`): when
  tasks are waiting, their pulls go to the driver, which batches them. (trio
  counts only the next batch of its scheduler: tasks still to run in the
  current one are not seen, and wait this one read. After it, the pull's
  task is runnable again, or the driver busy with the read it adopted, so
  the others of that batch go to the driver: at most one inline read per
  batch.)

What: ``make_prepped_xfer`` and ``transfer`` with the notification attached
(as the driver does for a one-transfer job: :meth:`InlineReads.start`), then
-- after the caller's schedule point, if it passes one while the READ runs
(``NixlBackend._run_job``) -- ``check_xfer_state`` until it ends or
``config._tuning.inline_read_spin`` passed (:meth:`InlineReads.finish`,
which first checks again that the driver, the loads and the poll are
idle). If it ended, the handle is released and the job ends here
(``job.error``: ``None``, or NIXL's exception as ``_errors`` maps it, as in
the driver); otherwise the driver
*adopts* the running transfer (the handle goes through its queue, and from
then on it owns it exactly as if it had posted it: stop, deadline and
linger rules included). A handle NIXL refuses to release is kept here and released at
close, after the driver has stopped.

Owned: the handles of transfers it posted until they are released or
adopted (between ``start`` and ``finish``, the caller's). Nothing here
awaits: cancellation cannot interrupt it (nor can KeyboardInterrupt: it is
protected, and so is ``_run_job`` between the two), and neither runs longer
than one small copy, or ``inline_read_spin``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import trio

from trio_pd._config import ConnectorConfig
from trio_pd._transfer._backend import BackendError
from trio_pd._transfer._nixl._driver import TransferDriver
from trio_pd._transfer._nixl._errors import nixl_error, release_or_keep
from trio_pd._transfer._nixl._jobs import Job


def no_task_runnable() -> bool:
    """Whether trio's run queue is empty (the scheduler's next batch has no task).

    :func:`trio.lowlevel.current_statistics` says it too (``tasks_runnable``),
    but builds its I/O statistics on the way by walking every registered
    file descriptor: in a server with thousands of connections, that walk
    would be most of an inline read's check. So this reads the length of the
    runner's queue, the very number ``tasks_runnable`` reports, and falls
    back to the public call if a trio release moves it (a test compares the
    two).
    """
    runner = getattr(trio._core._run.GLOBAL_RUN_CONTEXT, "runner", None)
    runq = getattr(runner, "runq", None)
    if runq is None:
        return trio.lowlevel.current_statistics().tasks_runnable == 0
    return not runq


NOT_TAKEN: Any = object()
"""What :meth:`InlineReads.start` returns for a job it did not take (submit it)."""


class InlineReads:
    """Reads the trio thread posts itself when the driver and the loop are idle.

    Trio thread only. ``idle_loads()`` says whether no remote-agent load or
    unload runs or is stuck in a worker thread; ``other_calls`` is the lock
    the notification thread holds around its NIXL calls.
    """

    def __init__(
        self,
        agent: Callable[[], Any],
        driver: TransferDriver,
        config: ConnectorConfig,
        idle_loads: Callable[[], bool],
        other_calls: threading.Lock,
    ) -> None:
        self._agent = agent
        self._driver = driver
        self._config = config
        self._idle_loads = idle_loads
        self._other_calls = other_calls
        self.posted = 0  # READs posted here (adopted ones included)
        self.adopted = 0  # of those, handed to the driver still running
        self.stuck: list[Any] = []  # handles NIXL refused to release (released at close)

    @trio.lowlevel.enable_ki_protection
    def read(self, job: Job) -> bool:
        """Run ``job`` here if it may be, without a schedule point; return whether it was taken.

        Taken means: it ended here (``job.ended`` and ``job.error`` set), or
        its transfer runs on and the driver adopted it (wait on
        ``job.finished`` as for any submitted job). Not taken: submit it.
        (:meth:`start` then :meth:`finish`, nothing between them.)
        """
        handle = self.start(job)
        if handle is NOT_TAKEN:
            return False
        if handle is not None:
            self.finish(job, handle)
        return True

    @trio.lowlevel.enable_ki_protection
    def start(self, job: Job) -> Any:
        """Post ``job``'s READ here if it may be.

        Returns :data:`NOT_TAKEN` (submit it instead); ``None`` when it
        ended here at once (``job.ended`` and ``job.error`` set); or the
        running transfer's handle, which the caller must pass to
        :meth:`finish` -- after a schedule point, if it likes (see
        ``NixlBackend._run_job``). ``other_calls`` is held only while this
        runs (and again in :meth:`finish`): a notification poll may run in
        between, on any thread.

        Protected from KeyboardInterrupt (it arrives at the caller's next
        checkpoint): raised between two NIXL calls here, it would leave a
        running transfer's handle neither released nor adopted.
        """
        if not self._eligible(job) or not self._other_calls.acquire(blocking=False):
            return NOT_TAKEN
        try:
            return self._post(job)
        finally:
            self._other_calls.release()

    @trio.lowlevel.enable_ki_protection
    def finish(self, job: Job, handle: Any) -> bool:
        """Check the READ that :meth:`start` posted until it ends, here, or hand it on.

        Here while the driver and the loads are still idle and the
        notification thread is not in NIXL (a schedule point since
        :meth:`start` may have given the driver work, started a load or a
        poll), for at most ``inline_read_spin``: the handle is released and
        the job ends here (returns ``True``: ``job.ended`` and ``job.error``
        set). Otherwise the driver adopts the running transfer (returns
        ``False``: wait on ``job.finished``; see :meth:`TransferDriver.adopt`
        for a driver that has stopped).
        """
        if self._driver.idle and self._idle_loads() and self._other_calls.acquire(blocking=False):
            try:
                handle = self._check(job, handle)
            finally:
                self._other_calls.release()
        if handle is None:
            return True
        self.adopted += 1
        self._driver.adopt(job, handle)
        return False

    def _post(self, job: Job) -> Any:
        """Post the READ; return its handle if it runs on, ``None`` if it ended."""
        agent = self._agent()
        now = time.monotonic()
        job.submitted_at = job.posted_at = now
        job.posted = job.size
        try:
            handle = agent.make_prepped_xfer(
                "READ",
                job.local_dlist,
                job.local_indices,
                job.remote_dlist,
                job.remote_indices,
                job.notification,
            )
        except Exception as exc:
            self._end(job, nixl_error("make_prepped_xfer", exc))
            return None
        self.posted += 1
        try:
            state = agent.transfer(handle)
        except Exception as exc:
            self._release(handle)
            self._end(job, nixl_error("transfer", exc))
            return None
        return self._running_or_ended(job, handle, state)

    def _check(self, job: Job, handle: Any) -> Any:
        """``check_xfer_state`` until the READ ends or the spin passed; return
        the handle if it still runs, ``None`` if it ended (released, job ended)."""
        agent = self._agent()
        state = "PROC"
        try:
            spin_until = time.monotonic() + self._config._tuning.inline_read_spin
            while state == "PROC" and time.monotonic() < spin_until:
                state = agent.check_xfer_state(handle)
        except Exception as exc:
            self._release(handle)
            self._end(job, nixl_error("check_xfer_state", exc))
            return None
        return self._running_or_ended(job, handle, state)

    def _running_or_ended(self, job: Job, handle: Any, state: str) -> Any:
        """``handle`` if its READ still runs (``state`` is ``"PROC"``); else
        release it, end the job (an error unless ``"DONE"``) and return ``None``."""
        if state == "PROC":
            return handle
        self._release(handle)
        self._end(job, None if state == "DONE" else BackendError(f"transfer state {state}"))
        return None

    def _eligible(self, job: Job) -> bool:
        limit = self._config.inline_read_bytes
        return (
            0 < job.size <= job.chunk
            and job.size * job.descriptor_bytes <= limit
            and self._driver.idle
            and self._idle_loads()
            and no_task_runnable()
        )

    def _end(self, job: Job, error: BackendError | None) -> None:
        """End ``job`` here (it was never handed to the driver: no events to set)."""
        job.ended, job.error = True, error
        job.finished_at = time.monotonic()
        job.local_dlist = job.remote_dlist = None  # (they keep the agent alive)

    def _release(self, handle: Any) -> None:
        release_or_keep(handle, self.stuck)

    def take_stuck(self) -> list[Any]:
        """The handles to release at close (after the driver stopped)."""
        stuck, self.stuck = self.stuck, []
        return stuck
