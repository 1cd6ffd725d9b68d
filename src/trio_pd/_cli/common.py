"""What ``trio-pd engine``, ``proxy`` and ``serve`` share: exit statuses,
the etcd flags (and the one place a membership is built from them), the
exposure secret."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from .._serve.engine import EXPOSURE_SECRET_ENV
from .._serve.membership import EtcdMembership, Membership

EXIT_OK = 0
EXIT_FAILED = 1  # could not start, or an engine failed
EXIT_USAGE = 2  # bad arguments (as argparse)


class UsageError(Exception):
    """A bad argument: the command prints it in one line and exits with status 2."""


def add_etcd_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--etcd", default="", metavar="URL", help="cluster membership on etcd (its client URL)"
    )
    parser.add_argument(
        "--etcd-prefix", default="/trio_pd/", metavar="PREFIX", help="key prefix in etcd"
    )
    parser.add_argument(
        "--etcd-ttl", type=float, default=10.0, metavar="SECONDS", help="etcd lease TTL"
    )


def membership_from_args(args: argparse.Namespace) -> Membership | None:
    """The membership the flags ask for (``None``: static URLs).

    This is where etcd plugs in: build it from ``args.etcd``,
    ``args.etcd_prefix`` and ``args.etcd_ttl``.

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
        return EtcdMembership(args.etcd, args.etcd_prefix, args.etcd_ttl)
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
