"""What ``trio-pd engine``, ``proxy`` and ``serve`` share: exit statuses,
the address flags, the etcd flags (and the one place a membership is built
from them), the exposure secret, and the keys (client keys, the internal key,
CURVE)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from trio_pd._curve_keys import ANY_ENGINE, CurveAuth
from trio_pd._serve.discovery import EtcdMembership, Membership
from trio_pd._serve.engine import EXPOSURE_SECRET_ENV
from trio_pd._serve.keys import API_KEY_ENV, INTERNAL_KEY_ENV, BearerKeys
from trio_pd._serve.proxy import DISPATCHES

DECODE_FIRST = "decode-first"
"""``trio-pd serve --dispatch decode-first``: no proxy; clients call decode-first
engines (``trio-pd engine --prefill-url``). Not a proxy's dispatch."""

ETCD_PASSWORD_ENV = "TRIO_PD_ETCD_PASSWORD"

EXIT_OK = 0
EXIT_FAILED = 1  # could not start, or an engine failed
EXIT_USAGE = 2  # bad arguments (as argparse)

EXIT_STATUSES: Mapping[str, Mapping[int, str]] = MappingProxyType(
    {
        "engine": {
            EXIT_OK: "drained after SIGTERM/SIGINT (or start-up abandoned on one)",
            EXIT_FAILED: "could not start: its address, its connectors; one line on stderr",
            EXIT_USAGE: (
                "bad arguments, or its ``--engine-id`` is held by a live engine in etcd "
                "(one line on stderr)"
            ),
        },
        "proxy": {
            EXIT_OK: "drained",
            EXIT_FAILED: (
                "could not start: its address, or etcd (unreachable, a wrong password or CA); "
                "one line on stderr"
            ),
            EXIT_USAGE: "bad arguments",
        },
        "serve": {
            EXIT_OK: (
                "drained, and every engine exited cleanly (or start-up abandoned on a signal)"
            ),
            EXIT_FAILED: (
                "an engine failed (at start, while serving, or in its drain: killed after "
                "``--grace`` + 5 s), or the proxy could not start (decode-first: the address "
                "of a decode engine cannot be bound)"
            ),
            EXIT_USAGE: "bad arguments",
        },
        "demo": {
            EXIT_OK: (
                "verified: no KV block arrived corrupt, and no request failed "
                "(but by the fault the flags injected)"
            ),
            EXIT_FAILED: (
                "not verified (the summary says why), or options that cannot run "
                "together, or ``--hosts`` unavailable (one line on stderr)"
            ),
            EXIT_USAGE: "bad arguments",
        },
        "keygen": {EXIT_OK: "the key pair printed", EXIT_USAGE: "bad arguments"},
    }
)
"""``trio-pd`` command -> exit status -> what it means (inline reST), every
status the command can exit with; ``docs/serving.md`` renders it (the
``exit-statuses`` directive of ``docs/_ext/pd_facts.py``)."""


class UsageError(Exception):
    """A bad argument: the command prints it in one line and exits with status 2."""


def add_address_arguments(
    parser: argparse.ArgumentParser,
    *,
    host: str,
    binds: str,
    advertise: str,
    port: int,
    port_help: str,
) -> None:
    """``--host``, ``--advertise-host`` and ``--port``, with the command's defaults
    (``host``, ``port``; ``--advertise-host`` defaults to ``--host``) and help:
    ``binds`` says what binds to ``--host``, ``advertise`` and ``port_help`` are
    the other two flags' help."""
    parser.add_argument("--host", default=host, help=f"{binds}; may be a wildcard (0.0.0.0, ::)")
    parser.add_argument("--advertise-host", default="", metavar="HOST", help=advertise)
    parser.add_argument("--port", type=int, default=port, help=port_help)


def add_etcd_arguments(parser: argparse.ArgumentParser, what: str, ttl: str) -> None:
    """``--etcd``, ``--etcd-prefix``, ``--etcd-ttl``: ``what`` the command does with
    etcd, ``ttl`` what the TTL is to it."""
    parser.add_argument("--etcd", default="", metavar="URL", help=f"etcd's client URL: {what}")
    parser.add_argument(
        "--etcd-prefix", default="/trio_pd/", metavar="PREFIX", help="key prefix in etcd"
    )
    parser.add_argument("--etcd-ttl", type=float, default=10.0, metavar="SECONDS", help=ttl)
    parser.add_argument(
        "--etcd-ca-file",
        default="",
        metavar="PATH",
        help="CA certificates (PEM) that an https:// etcd's certificate must chain to "
        "(default: the system's)",
    )
    parser.add_argument(
        "--etcd-cert-file",
        default="",
        metavar="PATH",
        help="a client certificate (PEM) for an etcd that asks for one",
    )
    parser.add_argument(
        "--etcd-key-file", default="", metavar="PATH", help="the client certificate's key (PEM)"
    )
    parser.add_argument(
        "--etcd-user", default="", metavar="NAME", help="etcd's authentication: the user"
    )
    parser.add_argument(
        "--etcd-password-file",
        default="",
        metavar="PATH",
        help=f"the --etcd-user's password (default: ${ETCD_PASSWORD_ENV})",
    )


def membership_from_args(
    args: argparse.Namespace, internal_key: str | None = None
) -> Membership | None:
    """The membership the flags ask for (``None``: static URLs).

    This is where etcd plugs in: build it from ``args.etcd``,
    ``args.etcd_prefix`` and ``args.etcd_ttl``; registrations are signed
    and verified with a key derived from ``internal_key``.

    Raises:
        UsageError: a bad etcd flag.
    """
    if args.etcd_ttl <= 0:
        raise UsageError("--etcd-ttl must be > 0")
    if not args.etcd_prefix.startswith("/"):
        raise UsageError("--etcd-prefix must start with '/'")
    if args.etcd:
        if not args.etcd.startswith(("http://", "https://")):
            raise UsageError(f"--etcd {args.etcd!r} is not an http(s) URL")
        tls = [f"--etcd-{n}-file" for n in ("ca", "cert", "key") if getattr(args, f"etcd_{n}_file")]
        if tls and not args.etcd.startswith("https://"):
            raise UsageError(f"{tls[0]} needs an https:// --etcd URL")
        if bool(args.etcd_cert_file) != bool(args.etcd_key_file):
            raise UsageError("--etcd-cert-file and --etcd-key-file go together")
        for flag in tls:
            _read(flag, getattr(args, flag.removeprefix("--").replace("-", "_")))
        password = ""
        if args.etcd_user:
            if args.etcd_password_file:
                password = _read("--etcd-password-file", args.etcd_password_file)
            else:
                password = os.environ.get(ETCD_PASSWORD_ENV, "").strip()
            if not password:
                raise UsageError(
                    f"--etcd-user needs a password: --etcd-password-file or ${ETCD_PASSWORD_ENV}"
                )
        elif args.etcd_password_file:
            raise UsageError("--etcd-password-file needs --etcd-user")
        return EtcdMembership(
            args.etcd,
            args.etcd_prefix,
            args.etcd_ttl,
            internal_key,
            ca_file=args.etcd_ca_file,
            cert_file=args.etcd_cert_file,
            key_file=args.etcd_key_file,
            user=args.etcd_user,
            password=password,
        )
    return None


def exposure_secret(secret_file: str) -> bytes | None:
    """The deployment's exposure secret: ``secret_file`` (hex) if given, else
    :data:`~trio_pd._serve.engine.EXPOSURE_SECRET_ENV`, else ``None``.

    Raises:
        UsageError: the file cannot be read, or either is not hex of at least 16 bytes.
    """
    if secret_file:
        try:
            text, source = (
                Path(secret_file).read_text().strip(),
                f"--exposure-secret-file {secret_file}",
            )
        except OSError as exc:
            raise UsageError(f"--exposure-secret-file: {exc.strerror}: {secret_file}") from None
    else:
        text, source = os.environ.get(EXPOSURE_SECRET_ENV, "").strip(), EXPOSURE_SECRET_ENV
    if not text:
        return None
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise UsageError(f"{source} must be hex") from None
    if len(secret) < 16:
        raise UsageError(f"{source} must hold at least 16 bytes (32 hex digits)")
    return secret


def _read(flag: str, path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise UsageError(f"{flag}: {exc.strerror}: {path}") from None


def add_internal_key_argument(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--internal-key-file",
        default="",
        metavar="PATH",
        help=f"the deployment's internal key, {what} (default: ${INTERNAL_KEY_ENV})",
    )


def add_send_timeout_argument(parser: argparse.ArgumentParser, default: float) -> None:
    parser.add_argument(
        "--send-timeout",
        type=float,
        default=default,
        metavar="SECONDS",
        help="how long an answer may wait for a client that stopped reading (unacknowledged, "
        "or against its full receive window): then the kernel resets the connection and the "
        "request is cancelled, freeing what it held (TCP_USER_TIMEOUT on the listening socket)",
    )


def add_dispatch_argument(
    parser: argparse.ArgumentParser, default: str, *, decode_first: bool = False
) -> None:
    """``--dispatch``: the proxy's two (``trio-pd proxy``), and with
    ``decode_first`` (``trio-pd serve``) a third, no proxy at all."""
    choices = (*DISPATCHES, DECODE_FIRST) if decode_first else DISPATCHES
    proxyless = (
        "; decode-first, no proxy at all: each decode engine is decode-first (trio-pd engine "
        "--prefill-url, naming every prefill engine) and clients call it; --port is then the "
        "first decode engine's (the M decode engines take --port to --port + M - 1) and "
        "--api-key guards the decode engines"
    )
    parser.add_argument(
        "--dispatch",
        choices=choices,
        default=default,
        help="when the proxy sends a decode request: concurrent, at once with its prefill "
        "request, the prefill's kv_transfer_params following as a second line of its body "
        "(the decode engine reads and checks it meanwhile; needs trio-pd engines); sequential, "
        f"once the prefill answered{proxyless if decode_first else ''} (default {default})",
    )


def add_lease_argument(parser: argparse.ArgumentParser, default: float) -> None:
    parser.add_argument(
        "--lease-initial",
        type=float,
        default=default,
        metavar="SECONDS",
        help="how long a prefill engine keeps exposed KV blocks that no decode engine holds "
        "yet (then they may serve another request); its answers say it, and the proxy starts "
        "no decode after it (docs/timeouts.md: the defaults are chosen together)",
    )


def add_admission_argument(parser: argparse.ArgumentParser, default: float) -> None:
    parser.add_argument(
        "--admission-timeout",
        type=float,
        default=default,
        metavar="SECONDS",
        help="how long a request waits for free KV blocks, first come first served, before "
        "a 503 with Retry-After (at most the exposure's cap, 30 s: a decode request waiting "
        "longer would find its prefill's exposure ended; default %(default)g)",
    )


def internal_key(key_file: str) -> str | None:
    """The deployment's internal key: ``key_file``'s content if given, else
    :data:`~trio_pd._serve.keys.INTERNAL_KEY_ENV`, else ``None``.

    Raises:
        UsageError: the file cannot be read, or the key is too short (the
            message never contains the key).
    """
    if key_file:
        key, source = _read("--internal-key-file", key_file), "--internal-key-file"
    else:
        key, source = os.environ.get(INTERNAL_KEY_ENV, "").strip(), f"${INTERNAL_KEY_ENV}"
    if not key:
        return None
    try:
        BearerKeys([key], audience="internal")
    except ValueError as exc:
        raise UsageError(f"{source}: {exc}") from None
    return key


def client_keys(flag_keys: list[str]) -> BearerKeys | None:
    """The client keys (of the proxy, or of a decode-first engine): every
    ``--api-key`` and those of :data:`~trio_pd._serve.keys.API_KEY_ENV`
    (one key, or several separated by spaces: how ``trio-pd serve`` hands
    its keys to decode-first engines); ``None`` if there are none.

    Raises:
        UsageError: a key is too short or not printable (never printed).
    """
    keys = [*flag_keys, *os.environ.get(API_KEY_ENV, "").split()]
    if not keys:
        return None
    try:
        return BearerKeys(keys, audience="client")
    except ValueError as exc:
        raise UsageError(f"--api-key/${API_KEY_ENV}: {exc}") from None


def curve_auth(key_file: str, peers_file: str, role: str) -> CurveAuth | None:
    """The engine's CURVE keys: its own pair (``key_file``, as ``trio-pd keygen``
    prints it) and its peers' public keys (``peers_file``: ``{"consumers":
    [keys], "producers": {engine_id or "*": key}}``; a prefill engine lets the
    consumers in, a decode engine expects the producers' keys). ``None`` when
    neither file is given.

    Raises:
        UsageError: only one file given, a file that cannot be read or is not
            such JSON, or keys that do not fit (never printed).
    """
    if not key_file and not peers_file:
        return None
    if not key_file or not peers_file:
        raise UsageError("--curve-key-file and --curve-peers-file go together")
    pair = _json("--curve-key-file", key_file)
    peers = _json("--curve-peers-file", peers_file)
    consumers = peers.get("consumers", [])
    producers = peers.get("producers", {})
    if not isinstance(consumers, list) or not isinstance(producers, dict):
        raise UsageError(
            "--curve-peers-file: 'consumers' must be a list of keys and 'producers' "
            "an object of keys by engine id"
        )
    if role == "prefill" and not consumers:
        raise UsageError("--curve-peers-file: a prefill engine needs 'consumers' (public keys)")
    if role == "decode" and not producers:
        raise UsageError(
            f"--curve-peers-file: a decode engine needs 'producers' (use {ANY_ENGINE!r} "
            "for a key that every prefill engine shares)"
        )
    try:
        return CurveAuth(
            public_key=pair["public_key"],
            secret_key=pair["secret_key"],
            allowed_consumers=frozenset(consumers),
            producer_keys=producers,
        )
    except KeyError as exc:
        raise UsageError(f"--curve-key-file: no {exc.args[0]!r} (see trio-pd keygen)") from None
    except (TypeError, ValueError) as exc:
        raise UsageError(f"CURVE keys: {exc}") from None


def _json(flag: str, path: str) -> dict[str, Any]:
    try:
        value = json.loads(_read(flag, path))
    except json.JSONDecodeError as exc:
        raise UsageError(f"{flag}: not JSON ({exc.msg}): {path}") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag}: a JSON object is needed: {path}")
    return value
