"""Child processes driven over pipes (prefill workers, latency relays, registered engines).

The parent writes to the child's stdin and reads lines from its stdout; the
child runs until its stdin reaches end of file. :func:`open_child` owns the
process: on every exit it closes the child's stdin, gives it a moment to
finish, kills it if it does not, reaps it and closes the pipes.

**The fork server.** A new Python process that imports torch, NIXL, numpy,
trio and trio_pd spends about 2 s of CPU before it does anything (measured
here: 1.8 s for ``import torch, nixl``), and the test suite starts about a
hundred prefill workers. So a child in this network namespace is forked
from a *fork server* instead: one process per parent (:class:`ForkServer`),
started at the first child, which imports those modules once and then
forks a child per request, as ``multiprocessing``'s forkserver with its
``preload`` does (and as PyTorch's DataLoader forks workers after
importing torch). The child gets the parent's current stdin/stdout pipes,
stderr, working directory and environment (with the request's additions)
and runs ``module.main()``; it has imported nothing the exec'd child would
not, and creates its NIXL agent and ZeroMQ context after the fork, as the
exec'd child does. The server imports but never runs trio, never opens a
socket but its control one, and starts no thread of its own (numpy's BLAS
may have one; it re-creates it after a fork). It exits when the parent's
end of its control socket closes. The parent waits for a forked child
through a pidfd (it is not the child's parent) and asks the server to
reap it, which also gives the exit status.

A child in another network namespace (``netns``) is started with ``ip
netns exec`` as before. ``TRIO_PD_FORK_SERVER=0`` in the environment turns
the fork server off (every child exec'd): to tell a problem of the fork
from one of the child.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import traceback
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

import trio

EXIT_TIMEOUT = 10.0
"""How long a child may take to exit after its stdin closed, before it is killed."""

PRELOAD = ("numpy", "torch", "nixl._api", "zmq", "trio", "trio_pd._harness._prefill_child")
"""What the fork server imports once, before it forks any child."""

_HEADER = struct.Struct("!I")
_MAX_FDS = 3


class ForkServerError(RuntimeError):
    """The fork server could not start a child (it died, or refused the request)."""


def _send_message(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [_HEADER.pack(len(data)) + data], list(fds))
    else:
        sock.sendall(_HEADER.pack(len(data)) + data)


def _receive_message(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """One message and the descriptors sent with it (``({}, [])`` at end of file)."""
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    if not head:
        return {}, fds
    while len(head) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(head))
        if not more:
            return {}, fds
        head += more
    (size,) = _HEADER.unpack(head)
    data = b""
    while len(data) < size:
        more = sock.recv(size - len(data))
        if not more:
            return {}, fds
        data += more
    message: dict[str, Any] = json.loads(data)
    return message, fds


class ForkServer:
    """The parent's end of its fork server (see the module docstring).

    One per process (:meth:`get`), started at the first request and kept for
    the life of the process. Requests are short blocking exchanges on a Unix
    socket, made one at a time (a lock); :meth:`fork` may wait for the
    server's imports, so callers run it in a worker thread.
    """

    _instance: ForkServer | None = None
    _instance_lock = threading.Lock()

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._socket = ours
        self._lock = threading.Lock()
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-c",
                "import trio_pd._harness._child_process as m; m.serve_forks()",
                str(theirs.fileno()),
            ],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
        )
        theirs.close()

    @classmethod
    def get(cls) -> ForkServer:
        """This process's fork server (started now if it is not running)."""
        with cls._instance_lock:
            if cls._instance is None or cls._instance._process.poll() is not None:
                cls._instance = ForkServer()
            return cls._instance

    def _request(self, message: dict[str, Any], fds: Sequence[int] = ()) -> dict[str, Any]:
        with self._lock:
            try:
                _send_message(self._socket, message, fds)
                reply, _ = _receive_message(self._socket)
            except OSError as exc:
                raise ForkServerError(f"the fork server is gone: {exc}") from None
        if not reply:
            raise ForkServerError("the fork server is gone (it closed its socket)")
        if "error" in reply:
            raise ForkServerError(str(reply["error"]))
        return reply

    def fork(self, module: str, argument: str, env: Mapping[str, str], fds: list[int]) -> int:
        """Fork a child that runs ``module.main()`` with ``fds`` as its stdin,
        stdout and stderr; return its pid. Blocks (the first time, for the
        server's imports)."""
        message = {"op": "fork", "module": module, "argument": argument, "env": dict(env)}
        message["cwd"] = os.getcwd()
        return int(self._request(message, fds)["pid"])

    def reap(self, pid: int) -> int:
        """Reap the exited child ``pid``; its return code (as ``Popen``'s: -N for signal N)."""
        return int(self._request({"op": "reap", "pid": pid})["returncode"])


def serve_forks() -> None:
    """The fork server's main (see the module docstring): import
    :data:`PRELOAD`, then answer ``fork`` and ``reap`` requests until the
    parent closes its end."""
    control = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        importlib.import_module(name)
    while True:
        message, fds = _receive_message(control)
        if not message:
            os._exit(0)
        try:
            if message["op"] == "fork":
                pid = os.fork()
                if pid == 0:
                    control.close()
                    _run_forked_child(message, fds)  # (never returns)
                reply: dict[str, Any] = {"pid": pid}
            else:
                _, status = os.waitpid(int(message["pid"]), 0)
                reply = {"returncode": os.waitstatus_to_exitcode(status)}
        except Exception as exc:  # (reported to the parent, which raises it)
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            for fd in fds:
                os.close(fd)
        _send_message(control, reply)


def _run_forked_child(message: dict[str, Any], fds: list[int]) -> None:
    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(message["cwd"])
        os.environ.clear()
        os.environ.update(message["env"])
        paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
        sys.path[1:1] = [p for p in paths if p and p not in sys.path]  # (as an exec would)
        sys.argv = ["-c", message["argument"]]
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        importlib.import_module(message["module"]).main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: ASYNC103 -- a forked child's top level, no trio here
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


class ChildProcess(Protocol):
    """What :func:`open_child` yields: a :class:`trio.Process`, or a :class:`ForkedChild`."""

    stdin: trio.abc.SendStream | None
    stdout: trio.abc.ReceiveStream | None
    pid: int

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


class ForkedChild:
    """A child forked by the fork server, as much of :class:`trio.Process`
    as :func:`open_child`'s users need: ``stdin``, ``stdout``, ``pid``,
    ``returncode``, :meth:`wait`, :meth:`kill`, :meth:`send_signal`.

    Owns the pidfd it waits on and the parent's ends of the pipes (closed by
    :func:`open_child`).
    """

    def __init__(self, server: ForkServer, pid: int, stdin_fd: int, stdout_fd: int) -> None:
        self._server = server
        self.pid = pid
        self._pidfd = os.pidfd_open(pid)
        self.stdin: trio.abc.SendStream | None = trio.lowlevel.FdStream(stdin_fd)
        self.stdout: trio.abc.ReceiveStream | None = trio.lowlevel.FdStream(stdout_fd)
        self.returncode: int | None = None

    async def wait(self) -> int:
        """Wait until the child exits; reap it (through the server) once."""
        if self.returncode is None:
            await trio.lowlevel.wait_readable(self._pidfd)
            if self.returncode is None:
                self.returncode = self._server.reap(self.pid)
                os.close(self._pidfd)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` to the child, unless it was reaped already (its pid
        is not reused before: the server reaps only when asked)."""
        if self.returncode is None:
            signal.pidfd_send_signal(self._pidfd, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


async def _fork_child(module: str, argument: str, env: Mapping[str, str]) -> ForkedChild:
    """Start ``module.main()`` through the fork server, with new pipes for
    stdin and stdout and this process's stderr."""
    stdin_read, stdin_write = os.pipe()
    stdout_read, stdout_write = os.pipe()
    try:
        server = await trio.to_thread.run_sync(ForkServer.get)
        pid = await trio.to_thread.run_sync(
            server.fork, module, argument, env, [stdin_read, stdout_write, 2]
        )
    except BaseException:
        for fd in (stdin_write, stdout_read):
            os.close(fd)
        raise
    finally:
        os.close(stdin_read)
        os.close(stdout_write)
    return ForkedChild(server, pid, stdin_write, stdout_read)


@asynccontextmanager
async def open_child(
    module: str, argument: str, *, netns: str = "", env: Mapping[str, str] | None = None
) -> AsyncIterator[ChildProcess]:
    """Run ``module.main()`` in a new Python process, ``argument`` in ``sys.argv[1]``,
    with stdin and stdout as pipes: forked from the fork server (see the
    module docstring), or, in another network namespace, exec'd.

    ``netns``: run it in that network namespace (``ip netns exec``, which
    execs, so the process is the Python one). ``env``: variables added to
    this process's environment for it.

    (Not ``python -m module``: runpy warns about running a module that its
    package's ``__init__`` already imported, as a package that re-exports it
    does.)

    Resource handling: on exit (normal, error or cancellation; shielded) the
    child's stdin is closed, the child is waited for at most
    :data:`EXIT_TIMEOUT` seconds and killed if still running, then reaped; both
    pipes are closed.
    """
    process: ChildProcess
    if not netns and os.environ.get("TRIO_PD_FORK_SERVER", "1") != "0":
        process = await _fork_child(module, argument, {**os.environ, **(env or {})})
    else:
        prefix = ["ip", "netns", "exec", netns] if netns else []
        process = await trio.lowlevel.open_process(
            [*prefix, sys.executable, "-c", f"import {module} as m; m.main()", argument],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env={**os.environ, **(env or {})},
        )
    try:
        yield process
    finally:
        with trio.CancelScope(shield=True):
            if process.stdin is not None:
                await process.stdin.aclose()
            with trio.move_on_after(EXIT_TIMEOUT):
                await process.wait()
            if process.returncode is None:
                process.kill()
                await process.wait()
            if process.stdout is not None:
                await process.stdout.aclose()


async def read_lines(stream: trio.abc.ReceiveStream) -> AsyncGenerator[bytes, None]:
    """The non-empty lines of ``stream``, without their newlines, until it ends."""
    buffer = b""
    async for chunk in stream:
        buffer += chunk
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            if line.strip():
                yield line
