"""Shared helpers: small KV caches and a bound on every test.

Real-path tests use real NIXL agents (UCX, DRAM), real ZeroMQ sockets on
loopback and real prefill processes; nothing here fakes them.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib.util
import io
import logging
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import trio

import trio_pd


def kv_cache(
    regions: int = 4,
    blocks: int = 32,
    block_shape: tuple[int, ...] = (16, 128),
    dtype: torch.dtype = torch.float16,
) -> list[torch.Tensor]:
    """``regions`` zeroed CPU tensors of shape ``(blocks, *block_shape)``."""
    return [torch.zeros((blocks, *block_shape), dtype=dtype) for _ in range(regions)]


def open_fds() -> int:
    """Open file descriptors, after collecting garbage.

    Earlier tests may leave unreachable objects in reference cycles (an
    exception kept by ``pytest.raises``, say) that still hold a connector;
    collecting first makes the count about leaks, not about GC timing.
    """
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def live_threads() -> int:
    """Threads of this process, not counting trio's idle cached worker threads.

    trio keeps finished ``to_thread`` workers for reuse (named "Trio thread N"
    while idle): they are the thread pool, not a leak. Everything else --
    ZeroMQ's I/O threads, UCX's progress thread, a busy worker -- counts.
    """
    gc.collect()
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                name = comm.read().strip()
        except FileNotFoundError:
            continue  # exited while we looked
        count += not name.startswith("Trio thread")
    return count


async def assert_back_to(fds: int, threads: int | None = None) -> None:
    """Assert that open file descriptors (and threads) are not above a baseline.

    A thread or descriptor that a close has already let go of may take a
    moment more to disappear: a trio worker thread is renamed back to
    "Trio thread N" just after its caller was woken, UCX's and ZeroMQ's
    threads exit after their contexts were told to. So the counts are read
    until neither is above its baseline, for at most 5 s; a leak never goes
    back, and fails with both numbers.

    Fewer than the baseline is not a leak: the baseline may have counted
    something an earlier test was still letting go of (a worker thread
    still busy finishing an abandoned call, a context's I/O thread on its
    way out) that ended since. CI saw exactly that once (4 threads where
    the baseline had 5), so the check is "not above", which every leak
    still fails: what a test opens and keeps only adds.
    """
    got = (-1, -1)
    with trio.move_on_after(5.0):
        while True:
            got = (open_fds(), live_threads() if threads is not None else -1)
            if got[0] <= fds and (threads is None or got[1] <= threads):
                return
            await trio.sleep(0.01)
    assert got[0] <= fds, f"file descriptors: {got[0]}, more than the {fds} before"
    if threads is not None:
        assert got[1] <= threads, f"threads: {got[1]}, more than the {threads} before"


FAST = trio_pd.ConnectorConfig(handshake_timeout=2.0, transfer_timeout=10.0, close_timeout=5.0)


@pytest.fixture
def fast_config() -> trio_pd.ConnectorConfig:
    return FAST


TEST_HOSTS_LOCK = Path(tempfile.gettempdir()) / f"trio-pd-test-hosts-{os.getuid()}.lock"
"""Held, exclusively, by every test marked ``test_hosts`` while it runs.

Test hosts have fixed addresses (``198.18.i.0/24``) and a machine-wide
route, so two sets at once collide: a test-host test runs alone among
test-host tests, on this machine (of this run or another). The other tests
do not take it: they run beside test hosts, because they keep UCX on the
loopback interface (:data:`ROOT_NAMESPACE_UCX`)."""

ROOT_NAMESPACE_UCX = {"UCX_NET_DEVICES": "lo"}
"""UCX's devices for every test that does not make test hosts (set for the
whole run, unless the caller chose UCX's devices): only loopback.

While test hosts' veth links come and go, UCX creating an agent in the root
namespace enumerates a link that is about to vanish and fails ("failed to
get interface index for tpd...r0: No such device"; measured here with links
added and deleted in a loop: 39 of 269 agent creations failed, 0 of 411
with ``UCX_NET_DEVICES=lo``). Every such test talks to 127.0.0.1 only. A
test-host test has it removed (its connectors reach the hosts over the veth
links), and so do the processes it starts."""

for _name, _value in ROOT_NAMESPACE_UCX.items():
    os.environ.setdefault(_name, _value)


@pytest.fixture(autouse=True)
def _test_hosts_run_alone(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[None]:
    """For a test marked ``test_hosts``: the exclusive hold on
    :data:`TEST_HOSTS_LOCK` (``flock``), and UCX on every interface, from
    before its other fixtures to after their teardown.

    A sync fixture: it blocks, if it must, before the test's trio loop starts.
    The lock goes with its file descriptor, closed on every exit path (and by
    the kernel if the worker dies).
    """
    if request.node.get_closest_marker("test_hosts") is None:
        yield
        return
    for name in ROOT_NAMESPACE_UCX:
        monkeypatch.delenv(name, raising=False)
    with TEST_HOSTS_LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


TEST_HOSTS_NODEIDS = "TRIO_PD_TEST_HOSTS_NODEIDS"
"""Environment variable: the file where each xdist worker writes the node ids
of the tests marked ``test_hosts`` it collected (set by the controller for
its workers; the scheduler below reads it)."""


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist's controller: a fresh file for :data:`TEST_HOSTS_NODEIDS`
    (the workers inherit the variable; removed at the end)."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    folder = Path(tempfile.mkdtemp(prefix="trio-pd-xdist-"))
    config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
    os.environ[TEST_HOSTS_NODEIDS] = str(folder / "test-hosts.txt")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the exercises that need root and test hosts, unless asked for;
    then put the tests marked ``test_hosts`` first, then those marked ``slow``
    (otherwise in order: the workers then end on short tests, not with one
    worker still in a long one), and, in an xdist worker, name the test-host
    tests in :data:`TEST_HOSTS_NODEIDS`.

    ``TRIO_PD_EXERCISE_HOSTS=1`` runs them (docs/exercises.md says so). They
    are deselected rather than skipped: a skip fails the run (below). The
    test-host tests run one at a time (:data:`TEST_HOSTS_LOCK`), all on one
    worker (:class:`TestHostsOnOneWorker`): the other worker never waits for
    the lock, it runs the rest.
    """
    if os.environ.get("TRIO_PD_EXERCISE_HOSTS") != "1":
        kept = [item for item in items if item.get_closest_marker("exercise_hosts") is None]
        if len(kept) < len(items):
            config.hook.pytest_deselected(items=[i for i in items if i not in kept])
            items[:] = kept
    items.sort(  # (stable: otherwise in collection order)
        key=lambda item: (
            item.get_closest_marker("test_hosts") is None,
            item.get_closest_marker("slow") is None,
        )
    )
    named = os.environ.get(TEST_HOSTS_NODEIDS)
    if hasattr(config, "workerinput") and named:
        hosts = [item.nodeid for item in items if item.get_closest_marker("test_hosts")]
        scratch = Path(f"{named}.{os.getpid()}")  # (every worker writes the same list)
        scratch.write_text("".join(f"{nodeid}\n" for nodeid in hosts))
        scratch.replace(named)


if importlib.util.find_spec("xdist") is not None:
    from xdist.scheduler import LoadScheduling

    class TestHostsOnOneWorker(LoadScheduling):
        """pytest-xdist's ``load`` scheduling, except that only the first
        worker is dealt tests marked ``test_hosts``.

        Those take :data:`TEST_HOSTS_LOCK` one at a time: dealt to both
        workers, one of them waited for the other's (53 s of a 530 s run's
        worker time, measured). xdist's ``loadgroup`` would do this, but its
        group suffix on the node id is not applied under pytest 9 (measured),
        so the workers name the tests in :data:`TEST_HOSTS_NODEIDS` instead.
        Everything else is xdist's: tests dealt one by one in collection
        order (``--maxschedchunk 1``) to whichever worker is free.
        """

        __test__ = False  # (not a test class, despite its name)

        _hosts: set[int] | None = None

        def _host_indices(self) -> set[int]:
            if self._hosts is None:
                named = Path(os.environ.get(TEST_HOSTS_NODEIDS, "/nonexistent"))
                nodeids = set(named.read_text().split("\n")) if named.exists() else set()
                self._hosts = {i for i, nodeid in enumerate(self.collection) if nodeid in nodeids}
            return self._hosts

        def _send_tests(self, node: Any, num: int) -> None:
            if node is self.nodes[0]:
                super()._send_tests(node, num)
                return
            hosts = self._host_indices()
            chosen = [index for index in self.pending if index not in hosts][:num]
            if chosen:
                self.pending[:] = [index for index in self.pending if index not in chosen]
                self.node2pending[node].extend(chosen)
                node.send_runtest_some(chosen)

        def schedule(self) -> None:
            # xdist deals a small run round-robin, one test each, and a
            # worker holds its last test until it gets a second or is shut
            # down: the test-host tests that _send_tests kept from the other
            # workers go to the first one here (without this, a run of a few
            # test-host tests waited forever).
            super().schedule()
            for node in self.nodes:
                self.check_schedule(node)

        def check_schedule(self, node: Any, duration: float = 0) -> None:
            super().check_schedule(node, duration)
            # A worker that will get nothing more stops (it runs what it holds
            # first): every worker once nothing is pending, the others once
            # only test-host tests are.
            hosts = self._host_indices()
            only_hosts = all(index in hosts for index in self.pending)
            for other in self.nodes:
                if not other.shutting_down and (
                    not self.pending or (only_hosts and other is not self.nodes[0])
                ):
                    other.shutdown()

    @pytest.hookimpl(optionalhook=True)  # (xdist's hook: unknown under -p no:xdist)
    def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
        """:class:`TestHostsOnOneWorker` for ``--dist load``; xdist's own otherwise."""
        if config.getoption("dist") != "load":
            return None
        return TestHostsOnOneWorker(config, log)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A skipped test is a broken set-up here: every test runs on the real path."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter is not None else 0
    if skipped and os.environ.get("TRIO_PD_ALLOW_SKIPS") != "1" and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        if reporter is not None:
            reporter.write_line(
                f"{skipped} test(s) skipped: every test must run on the real path "
                "(set TRIO_PD_ALLOW_SKIPS=1 to allow)",
                red=True,
            )


@contextlib.contextmanager
def terminal_capture(*, stderr: bool = False) -> Iterator[io.StringIO]:
    """What a program run in this process prints while the block runs: its
    stdout (and ``stderr``), with the library's warnings where a terminal
    shows them, between the lines printed (message only, as Python's
    last-resort handler writes them)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setLevel(logging.WARNING)
    library = logging.getLogger("trio_pd")
    library.addHandler(handler)
    try:
        with contextlib.redirect_stdout(out), contextlib.ExitStack() as stack:
            if stderr:
                stack.enter_context(contextlib.redirect_stderr(out))
            yield out
    finally:
        library.removeHandler(handler)


def run_here(path: Path) -> str:
    """What a docs program prints, run in this process (``runpy``, as
    ``__main__``): :func:`terminal_capture`'s output."""
    with terminal_capture() as out:
        runpy.run_path(str(path), run_name="__main__")
    return out.getvalue()


async def wait_until(condition: Callable[[], object], interval: float = 0.001) -> None:
    """Poll ``condition`` (state owned by another task or process) until true.

    Bound the wait with ``trio.fail_after`` / ``move_on_after`` around it.
    """
    while not condition():  # noqa: ASYNC110 -- nothing to wait on: foreign state
        await trio.sleep(interval)


def run_in_terminal_order(path: Path, timeout: float) -> tuple[int, str]:
    """Run a docs program in its own interpreter as a terminal shows it: its
    exit status, and its output with the library's log lines (stderr) where
    they come, unbuffered."""
    result = subprocess.run(
        [sys.executable, str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
        env={**os.environ, "NIXL_LOG_LEVEL": "WARN", "PYTHONUNBUFFERED": "1"},
        check=False,
    )
    return result.returncode, result.stdout


def run_doc_script(path: Path, timeout: float) -> str:
    """Run a docs script (an example or an exercise) in its own interpreter:
    its stdout (it must exit 0 and print something)."""
    result = subprocess.run(
        [sys.executable, str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "NIXL_LOG_LEVEL": "WARN"},
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip(), result.stderr
    return result.stdout
