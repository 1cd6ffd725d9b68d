"""A real etcd server: one member on loopback (and any addresses asked for), in a temp dir.

:func:`open_etcd` starts Debian's ``etcd`` (package ``etcd-server``; the nox
``tests`` session installs it when missing), waits until it answers, and
yields an :class:`EtcdServer` whose :meth:`~EtcdServer.kill`,
:meth:`~EtcdServer.stop` and :meth:`~EtcdServer.start` make outages: a
restart keeps the ports and the data directory, so keys and leases survive
it as they would on a real deployment.

``trio-pd serve --hosts N`` runs one for its test hosts (listening on each
link's root address too), with TLS and authentication on; the tests run one
per test (``trio_pd.testing`` re-exports it).

``open_etcd(tls=True)`` serves HTTPS only, with certificates made for the run
(``openssl``, in the temporary directory: a CA, and the server's for its
addresses); ``password=...`` turns etcd's authentication on, user ``root`` (its tokens
last 2 s unused, so that clients renew them).
(It asks no client certificate: etcd's JSON gateway refuses a request whose
client certificate names a CommonName.)
"""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import subprocess
import tempfile
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx2
import trio

from trio_pd._serve.ports import free_port_range

ETCD_PATHS = ("/usr/bin/etcd", "/usr/local/bin/etcd")
START_TIMEOUT = 15.0
STOP_TIMEOUT = 5.0


class EtcdUnavailable(RuntimeError):
    """etcd could not be started: its binary is missing, or it did not come up."""


def find_etcd() -> str:
    """The ``etcd`` binary's path.

    Raises:
        EtcdUnavailable: there is none (install Debian's ``etcd-server``).
    """
    found = shutil.which("etcd")
    if found is not None:
        return found
    for path in ETCD_PATHS:
        if os.access(path, os.X_OK):
            return path
    raise EtcdUnavailable(
        "no etcd binary on PATH or in /usr/bin: install it (apt-get install etcd-server; "
        "`nox -s tests` does) to run the membership tests"
    )


class EtcdServer:
    """A one-member etcd cluster run by :func:`open_etcd`.

    Attributes:
        url: its client URL, ``http://127.0.0.1:PORT`` (in a network
            namespace: ``http://ADDRESS:PORT``, its first address).
        addresses: the addresses it listens on (127.0.0.1 first, outside a
            namespace), all on ``url``'s port.
        data_dir: its data directory (kept across :meth:`start`).
        tls: whether it serves HTTPS only.
        ca_file: the CA of its certificate (with ``tls``).
        user: its authentication's user (``""``: off).
        password: that user's password.

    It runs with a 10 ms heartbeat and a 100 ms election timeout, so that
    it starts and restarts in a fraction of a second (etcd's minimum lease
    TTL is then 1 s instead of the default 2 s).
    """

    def __init__(
        self,
        binary: str,
        directory: Path,
        client_port: int,
        peer_port: int,
        addresses: Sequence[str] = (),
        netns: str = "",
        *,
        tls: bool = False,
        password: str = "",
    ) -> None:
        if netns and not addresses:
            raise ValueError("etcd in a network namespace needs its address there")
        if not netns:
            addresses = ("127.0.0.1", *(a for a in addresses if a != "127.0.0.1"))
        self.addresses = tuple(addresses)
        self._port = client_port
        self._netns = netns
        self.tls = tls
        self.user = "root" if password else ""
        self.password = password
        self.ca_file = str(directory / "ca.pem") if tls else ""
        self._directory = directory
        self._auth_enabled = False
        self.url = self.url_at(self.addresses[0])
        self.data_dir = directory / "data"
        self._binary = binary
        self._log = directory / "etcd.log"
        self._peer = f"http://127.0.0.1:{peer_port}"
        self._process: trio.Process | None = None

    def url_at(self, address: str) -> str:
        """Its client URL at ``address`` (one of :attr:`addresses`)."""
        if address not in self.addresses:
            raise ValueError(f"etcd does not listen on {address} (only {self.addresses})")
        return f"{'https' if self.tls else 'http'}://{address}:{self._port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    def log_tail(self, lines: int = 20) -> str:
        """The end of etcd's own log (for failure messages)."""
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""

    async def start(self) -> None:
        """Start etcd (again, on the same ports and data) and wait until it answers.

        Raises:
            EtcdUnavailable: it exited, or did not answer within
                15 s (the message has its log's end).
        """
        if self.running:
            raise RuntimeError("etcd is already running")
        command = [
            *(["ip", "netns", "exec", self._netns] if self._netns else []),  # (ip execs it)
            self._binary,
            "--name=test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={','.join(map(self.url_at, self.addresses))}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={self._peer}",
            f"--initial-advertise-peer-urls={self._peer}",
            f"--initial-cluster=test={self._peer}",
            "--heartbeat-interval=10",
            "--election-timeout=100",
            "--logger=zap",
            "--log-level=warn",
            "--auth-token-ttl=2",  # (seconds: clients must renew their tokens)
        ]
        if self.tls:
            if not await trio.Path(self.ca_file).exists():
                await _make_certificates(self._directory, self.addresses)
            command += [
                f"--cert-file={self._directory / 'server.pem'}",
                f"--key-file={self._directory / 'server.key'}",
            ]
        log = os.open(self._log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self._process = await trio.lowlevel.open_process(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                # (a terminal's Ctrl-C reaches its owner alone, which stops it last)
                start_new_session=True,
            )
        finally:
            os.close(log)
        try:
            with trio.fail_after(START_TIMEOUT):
                await self._wait_answering()
        except trio.TooSlowError:
            reason = f"no answer within {START_TIMEOUT} s"
        except EtcdUnavailable as exc:
            reason = str(exc)
        except BaseException:  # (cancelled while it starts: it must not outlive us)
            with trio.move_on_after(STOP_TIMEOUT, shield=True):
                await self.kill()
            raise
        else:
            if self.password and not self._auth_enabled:
                await self._enable_auth()
            return
        await self.kill()
        raise EtcdUnavailable(
            f"etcd did not start at {self.url} ({reason}); its log ends:\n{self.log_tail()}"
        )

    def http_client(self) -> httpx2.AsyncClient:
        """An HTTP client for it (with the CA and client certificate under TLS)."""
        verify: ssl.SSLContext | bool = True
        if self.tls:
            verify = ssl.create_default_context(cafile=self.ca_file)
        return httpx2.AsyncClient(trust_env=False, timeout=2.0, verify=verify)

    async def _wait_answering(self) -> None:
        async with self.http_client() as client:
            while True:
                assert self._process is not None
                if self._process.returncode is not None:
                    raise EtcdUnavailable(f"it exited with status {self._process.returncode}")
                try:
                    response = await client.post(f"{self.url}/v3/maintenance/status", json={})
                except httpx2.TransportError:
                    pass
                else:
                    if response.status_code == 200:
                        return
                await trio.sleep(0.02)

    async def _enable_auth(self) -> None:
        """User ``root`` with the password, and etcd's authentication on."""
        async with self.http_client() as client:
            for path, body in (
                ("/v3/auth/user/add", {"name": "root", "password": self.password}),
                ("/v3/auth/role/add", {"name": "root"}),
                ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
                ("/v3/auth/enable", {}),
            ):
                response = await client.post(f"{self.url}{path}", json=body)
                if response.status_code != 200:
                    raise EtcdUnavailable(f"{path}: {response.status_code} {response.text}")
        self._auth_enabled = True

    async def kill(self) -> None:
        """SIGKILL etcd (a crash) and reap it. Nothing if it is not running."""
        process, self._process = self._process, None
        if process is not None:
            if process.returncode is None:
                process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()

    async def stop(self) -> None:
        """SIGTERM etcd (a clean stop, about 1.5 s), SIGKILL after 5 s."""
        process = self._process
        if process is not None and process.returncode is None:
            process.send_signal(signal.SIGTERM)
            with trio.move_on_after(STOP_TIMEOUT, shield=True):
                await process.wait()
        await self.kill()


async def _make_certificates(directory: Path, addresses: Sequence[str]) -> None:
    """A CA and a server certificate for ``addresses`` (EC P-256, valid two days),
    in ``directory``."""

    async def openssl(*args: str) -> None:
        try:
            await trio.run_process(["openssl", *args], capture_stdout=True, capture_stderr=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            raise EtcdUnavailable(
                f"cannot make etcd's TLS certificates with openssl: {exc}"
            ) from exc

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    await openssl(
        "req", "-x509", *key, "-keyout", f"{directory}/ca.key", "-out", f"{directory}/ca.pem",
        "-days", "2", "-subj", "/CN=trio-pd test CA",
    )  # fmt: skip
    sans = ",".join(f"IP:{address}" for address in addresses)
    for name, cn, usage, extra in (("server", "etcd", "serverAuth", f"subjectAltName={sans}\n"),):
        extensions = directory / f"{name}.ext"
        await trio.Path(extensions).write_text(f"{extra}extendedKeyUsage={usage}\n")
        await openssl(
            "req", *key, "-keyout", f"{directory}/{name}.key", "-out", f"{directory}/{name}.csr",
            "-subj", f"/CN={cn}",
        )  # fmt: skip
        await openssl(
            "x509", "-req", "-in", f"{directory}/{name}.csr", "-CA", f"{directory}/ca.pem",
            "-CAkey", f"{directory}/ca.key", "-CAcreateserial", "-days", "2",
            "-out", f"{directory}/{name}.pem", "-extfile", str(extensions),
        )  # fmt: skip


@asynccontextmanager
async def open_etcd(
    *, addresses: Sequence[str] = (), netns: str = "", tls: bool = False, password: str = ""
) -> AsyncIterator[EtcdServer]:
    """Run a fresh etcd on free loopback ports while the block runs; it also
    listens on each of ``addresses`` (of this host: a test host link's root
    end, say) on the same port. With ``netns`` it runs in that network
    namespace (a test host), listening on ``addresses`` there (at least one).
    ``tls``: HTTPS only, certificates made for the run (the server's
    ``ca_file`` is the CA); ``password``: etcd's
    authentication on, user ``root`` (the server's ``user``).

    Raises:
        EtcdUnavailable: no ``etcd`` binary (not a skip: install it), or it
            did not start.

    Resource handling: on exit etcd is killed and reaped and its data
    directory removed.
    """
    binary = find_etcd()
    with tempfile.TemporaryDirectory(prefix="trio-pd-etcd-") as directory:
        server = None
        for attempt in range(3):  # free ports can be taken before etcd binds them
            base = free_port_range(2)
            server = EtcdServer(
                binary,
                Path(directory),
                base,
                base + 1,
                addresses,
                netns,
                tls=tls,
                password=password,
            )
            try:
                await server.start()
                break
            except EtcdUnavailable:
                if attempt == 2:
                    raise
                shutil.rmtree(server.data_dir, ignore_errors=True)
        assert server is not None
        try:
            yield server
        finally:
            with trio.move_on_after(STOP_TIMEOUT, shield=True):
                await server.kill()
