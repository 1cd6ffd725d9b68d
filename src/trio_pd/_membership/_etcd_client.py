"""A small etcd v3 client over the JSON gateway, on trio, with httpx2.

Only what membership needs: leases (grant, keepalive, revoke), put, delete,
a conditional put (a transaction), a key and a prefix range, and a prefix
watch. Every failure -- no connection, no
answer in time, a broken stream, an error from etcd, an answer that is not
etcd's -- is one :class:`~trio_pd._membership._etcd_wire.MembershipError` naming its cause and
the endpoint, mapped here at the boundary (httpx2's exceptions never leak).

Why not a client library: no maintained etcd v3 client for Python runs on
trio. The maintained ones are synchronous (``etcd3gw``, on requests) or
asyncio-only (``aetcd``, ``etcd3aio``, ``etcd3-async-client``: gRPC's
``grpc.aio``, which needs an asyncio loop; ``async-etcd3gw``: aiohttp). The
gateway is part of every etcd server, and httpx2 (already a dependency) runs
on trio through anyio; the handful of calls below is the whole protocol.
"""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import httpx2
import trio

from trio_pd._membership import _etcd_wire as wire
from trio_pd._membership._etcd_wire import MembershipError


@attrs.frozen
class MembershipConfig:
    """Deadlines and intervals of the membership client (seconds).

    Attributes:
        connect_timeout: to open a connection to etcd.
        request_timeout: for any one request to be sent and answered (a
            watch stream waits for events without a deadline; the probe
            below notices a dead etcd instead).
        probe_interval: while watching, how often the view checks that etcd
            still answers (a watch that silently hangs is noticed within
            ``probe_interval + request_timeout``).
        retry_initial, retry_max: the view's reconnection backoff: the first
            wait after etcd went away, doubling up to the most.
        close_timeout: for an engine's registration to delete its key and
            revoke its lease when it ends (best effort: the lease's TTL
            removes the key anyway).
    """

    connect_timeout: float = 2.0
    request_timeout: float = 5.0
    probe_interval: float = 2.0
    retry_initial: float = 0.2
    retry_max: float = 5.0
    close_timeout: float = 2.0

    def __attrs_post_init__(self) -> None:
        for field in attrs.fields(type(self)):
            if not getattr(self, field.name) > 0:
                raise ValueError(f"MembershipConfig.{field.name} must be > 0")
        if self.retry_max < self.retry_initial:
            raise ValueError("MembershipConfig.retry_max must be >= retry_initial")


@attrs.frozen
class EtcdAccess:
    """How to reach an etcd that runs as operators run it: TLS and its own users.

    Attributes:
        ca_file: the CA certificates (PEM) that etcd's server certificate must
            chain to (``""``: the system's), for an ``https://`` URL.
        cert_file, key_file: a client certificate and its key (PEM), for an
            etcd that asks for one (``--client-cert-auth``).
        user, password: etcd's authentication (``""``: none): every request
            carries a token from ``/v3/auth/authenticate``, renewed when etcd
            says it is no longer valid.
    """

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    user: str = ""
    password: str = attrs.field(default="", repr=False)

    def ssl_context(self) -> ssl.SSLContext:
        """The TLS context for an ``https://`` etcd.

        Raises:
            ValueError: a file that cannot be read or is not PEM of its kind.
        """
        try:
            context = ssl.create_default_context(cafile=self.ca_file or None)
            if self.cert_file:
                context.load_cert_chain(self.cert_file, self.key_file or None)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"etcd TLS files: {exc}") from None
        return context


_UNAUTHENTICATED = 16  # gRPC: "etcdserver: invalid auth token" (expired, say)


class EtcdClient:
    """Requests to one etcd endpoint (``http://host:port`` or ``https://``).

    Use as ``async with EtcdClient(url, config) as client:``; it owns its
    HTTP connection pool, closed on exit. Proxy variables of the
    environment are ignored: etcd is reached directly. ``access``: TLS
    files and etcd's user and password.
    """

    def __init__(
        self, url: str, config: MembershipConfig | None = None, access: EtcdAccess | None = None
    ) -> None:
        self.url = url.rstrip("/")
        self.config = config or MembershipConfig()
        self.access = access or EtcdAccess()
        self._timeout = httpx2.Timeout(
            self.config.request_timeout, connect=self.config.connect_timeout
        )
        verify: ssl.SSLContext | bool = True
        if self.url.startswith("https://"):
            verify = self.access.ssl_context()
        self._http = httpx2.AsyncClient(timeout=self._timeout, trust_env=False, verify=verify)
        self._token: str | None = None

    async def __aenter__(self) -> EtcdClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections (shielded, bounded by ``close_timeout``; idempotent)."""
        with trio.move_on_after(self.config.close_timeout, shield=True):
            await self._http.aclose()

    # ---- unary calls ---------------------------------------------------------

    async def _headers(self, *, renew: bool = False) -> dict[str, str]:
        """The token header, authenticating first if needed (none without a user)."""
        if not self.access.user:
            return {}
        if self._token is None or renew:
            self._token = None
            answer = await self._post(
                "/v3/auth/authenticate",
                {"name": self.access.user, "password": self.access.password},
                {},
            )
            token = answer.get("token") if isinstance(answer, dict) else None
            if not isinstance(token, str) or not token:
                raise MembershipError(
                    f"{self.url}/v3/auth/authenticate", "bad_response", "no token"
                )
            self._token = token
        return {"Authorization": self._token}

    async def _call(self, path: str, body: dict[str, Any]) -> Any:
        try:
            return await self._post(path, body, await self._headers())
        except MembershipError as exc:
            if exc.code != _UNAUTHENTICATED or not self.access.user:
                raise
        return await self._post(path, body, await self._headers(renew=True))

    async def _post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        endpoint = f"{self.url}{path}"
        try:
            response = await self._http.post(endpoint, json=body, headers=headers)
        except httpx2.HTTPError as exc:
            raise _transport_error(endpoint, exc) from exc
        try:
            answer = json.loads(response.text)
        except ValueError:
            answer = None
        if response.status_code != 200:
            raise wire.parse_error_answer(endpoint, response.status_code, response.text, answer)
        if answer is None:
            raise MembershipError(endpoint, "bad_response", f"not JSON: {response.text[:200]!r}")
        return answer

    async def grant(self, ttl: int) -> wire.Lease:
        """A new lease of ``ttl`` seconds (etcd may grant more: its minimum TTL)."""
        return wire.parse_lease(self.url, await self._call("/v3/lease/grant", wire.grant_body(ttl)))

    async def keepalive(self, lease: int) -> int:
        """Renew ``lease`` once; the seconds it now has left, 0 if it no longer exists."""
        endpoint = f"{self.url}/v3/lease/keepalive"
        # A stream on the gateway: one request object in, one answer line out.
        answer = await self._call("/v3/lease/keepalive", wire.lease_body(lease))
        return wire.parse_lease(endpoint, wire.parse_stream_line(endpoint, answer)).ttl

    async def revoke(self, lease: int) -> None:
        """End ``lease`` and delete its keys (a lease that no longer exists is fine)."""
        try:
            await self._call("/v3/lease/revoke", wire.lease_body(lease))
        except MembershipError as exc:
            if exc.code != wire.NOT_FOUND:
                raise

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> int:
        """Set ``key``, attached to ``lease`` if not 0; the new store revision.

        A lease that no longer exists is a ``"rejected"`` error with code
        :data:`~trio_pd._membership._etcd_wire.NOT_FOUND`.
        """
        answer = await self._call("/v3/kv/put", wire.put_body(key, value, lease))
        return wire.header_revision(self.url, answer)

    async def claim(
        self, key: bytes, value: bytes, *, lease: int, mod_revision: int
    ) -> tuple[int, wire.KeyValue | None]:
        """Put ``key`` under ``lease`` only if it is absent (``mod_revision`` 0) or
        unchanged since ``mod_revision`` (one transaction); see
        :func:`~trio_pd._membership._etcd_wire.parse_claim` for the answer."""
        answer = await self._call("/v3/kv/txn", wire.claim_body(key, value, lease, mod_revision))
        return wire.parse_claim(self.url, answer)

    async def get(self, key: bytes) -> tuple[int, wire.KeyValue | None]:
        """``key`` (``None`` if absent), and the store revision it was read at."""
        answer = await self._call("/v3/kv/range", {"key": wire.b64(key)})
        revision, kvs = wire.parse_range(self.url, answer)
        return revision, kvs[0] if kvs else None

    async def delete(self, key: bytes) -> int:
        """Delete ``key`` (if it exists); the store revision after."""
        answer = await self._call("/v3/kv/deleterange", wire.delete_body(key))
        return wire.header_revision(self.url, answer)

    async def range_prefix(self, prefix: bytes) -> tuple[int, list[wire.KeyValue]]:
        """Every key under ``prefix``, and the store revision they were read at."""
        answer = await self._call("/v3/kv/range", wire.prefix_range_body(prefix))
        return wire.parse_range(self.url, answer)

    async def probe(self, prefix: bytes) -> int:
        """Check that etcd answers (a linearizable count of the prefix); the revision."""
        answer = await self._call("/v3/kv/range", wire.prefix_range_body(prefix, count_only=True))
        return wire.header_revision(self.url, answer)

    # ---- the watch stream ----------------------------------------------------

    @asynccontextmanager
    async def watch(
        self, prefix: bytes, start_revision: int
    ) -> AsyncIterator[AsyncIterator[wire.WatchMessage]]:
        """Watch every key under ``prefix`` from ``start_revision``: yields the messages.

        The stream waits for events without a read deadline. It raises
        :class:`MembershipError` (``"disconnected"``) when the connection
        breaks or the stream ends without etcd cancelling the watch; a
        message with ``canceled`` set is the last one.
        """
        endpoint = f"{self.url}/v3/watch"
        body = wire.watch_body(prefix, start_revision)
        timeout = httpx2.Timeout(
            self.config.request_timeout, connect=self.config.connect_timeout, read=None
        )
        headers = await self._headers()
        try:
            async with self._http.stream(
                "POST", endpoint, json=body, timeout=timeout, headers=headers
            ) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    try:
                        answer = json.loads(text)
                    except ValueError:
                        answer = None
                    raise wire.parse_error_answer(endpoint, response.status_code, text, answer)
                yield _WatchStream(endpoint, response)
        except httpx2.HTTPError as exc:
            raise _transport_error(endpoint, exc) from exc


class _WatchStream:
    """The messages of one watch stream (an async iterator over its lines)."""

    def __init__(self, endpoint: str, response: httpx2.Response) -> None:
        self._endpoint = endpoint
        self._lines = response.aiter_lines()  # (closed with the response)
        self._done = False

    def __aiter__(self) -> _WatchStream:
        return self

    async def __anext__(self) -> wire.WatchMessage:
        if self._done:
            raise StopAsyncIteration
        while True:
            try:
                line = await anext(self._lines)
            except StopAsyncIteration:
                raise MembershipError(
                    self._endpoint, "disconnected", "the watch stream ended"
                ) from None
            if line.strip():
                break
        try:
            answer = json.loads(line)
        except ValueError:
            raise MembershipError(
                self._endpoint, "bad_response", f"not JSON: {line[:200]!r}"
            ) from None
        message = wire.parse_watch_message(self._endpoint, answer)
        self._done = message.canceled
        return message


def _transport_error(endpoint: str, exc: httpx2.HTTPError) -> MembershipError:
    reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    cause: BaseException | None = exc
    while cause is not None and not isinstance(cause, ssl.SSLError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, ssl.SSLError):  # (a wrong CA, say: say so, in one line)
        detail = getattr(cause, "verify_message", None) or cause.reason or str(cause)
        reason = f"TLS: {detail}"
    if isinstance(exc, httpx2.TimeoutException):
        return MembershipError(endpoint, "timeout", reason)
    if isinstance(exc, httpx2.ConnectError):
        return MembershipError(endpoint, "unreachable", reason)
    return MembershipError(endpoint, "disconnected", reason)
