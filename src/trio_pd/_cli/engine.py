"""``trio-pd engine``: one prefill or decode engine (an HTTP server) for one host.

It binds ``--host:--port`` (a wildcard needs ``--advertise-host``, the
address peers and the proxy dial), opens one connector per tensor-parallel
rank (rank ``r`` on ``--side-channel-port`` + ``r``), and writes
``--ready-file`` (``{"url": ...}``) only once it accepts requests; SIGTERM
or SIGINT drains it (at most ``--grace`` s) and removes the ready file. See
``trio_pd._serve.process`` for the life of the process.

Exit status: 0 after a drain (or a start-up abandoned on a signal), 1 when
the engine could not start (one line on stderr says why), 2 for bad
arguments or an ``--engine-id`` that a live engine holds in etcd.
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys

import trio

from trio_pd._cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    add_address_arguments,
    add_admission_argument,
    add_etcd_arguments,
    add_internal_key_argument,
    add_lease_argument,
    add_send_timeout_argument,
    client_keys,
    curve_auth,
    exposure_secret,
    internal_key,
    membership_from_args,
)
from trio_pd._curve_keys import (
    ANY_ENGINE,
    CurveAuth,
    PeerKeys,
    deployment_keypair,
    generate_keypair,
)
from trio_pd._serve.engine import EXPOSURE_SECRET_ENV, EngineSettings
from trio_pd._serve.keys import API_KEY_ENV, INTERNAL_KEY_ENV, BearerKeys
from trio_pd._serve.model import ModelConfig
from trio_pd._serve.openai import MAX_MODEL_LEN
from trio_pd._serve.process import EngineStartError, serve_engine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = EngineSettings(engine_id="", http_port=0)
    parser.add_argument(
        "--role",
        required=True,
        choices=("prefill", "decode"),
        help="what the engine does for the proxy",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="tensor-parallel size: N connectors (N must divide the model's 2 KV heads)",
    )
    add_address_arguments(
        parser,
        host=defaults.host,
        binds="where HTTP and the side channel bind",
        advertise="the address that peers and the proxy dial, in kv_transfer_params and the "
        "ready file (default: --host); required with a wildcard --host",
        port=0,
        port_help="HTTP port (0: any free port, the ready file says which)",
    )
    parser.add_argument(
        "--side-channel-port",
        type=int,
        default=0,
        metavar="PORT",
        help="base port of the side channel: rank r listens on PORT + r (0: free ports)",
    )
    parser.add_argument(
        "--num-blocks",
        type=int,
        default=defaults.num_blocks,
        metavar="N",
        help="KV blocks in the engine's pool (at least 1)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=0,
        metavar="TOKENS",
        help=f"prompt + max_tokens (default: {MAX_MODEL_LEN}, or what --num-blocks holds)",
    )
    parser.add_argument(
        "--engine-id",
        default="",
        metavar="ID",
        help="the engine's name, in kv_transfer_params, errors and completion ids "
        "(default: ROLE-ADVERTISED_HOST-PORT)",
    )
    parser.add_argument(
        "--grace",
        type=float,
        default=defaults.grace,
        metavar="SECONDS",
        help="how long requests in flight may finish after SIGTERM/SIGINT",
    )
    add_send_timeout_argument(parser, defaults.send_timeout)
    add_lease_argument(parser, defaults.lease_initial)
    add_admission_argument(parser, defaults.admission_timeout)
    parser.add_argument(
        "--ready-file",
        default="",
        metavar="PATH",
        help='{"url": ...} (the advertised address), written once the engine accepts requests; '
        "removed on exit",
    )
    parser.add_argument(
        "--exposure-secret-file",
        default="",
        metavar="PATH",
        help=f"the deployment's exposure secret, hex, at least 16 bytes (default: "
        f"${EXPOSURE_SECRET_ENV})",
    )
    add_internal_key_argument(
        parser,
        "required on /v1/*, 401 without it (the proxy sends it); without one the engine "
        "warns that anyone may call it",
    )
    parser.add_argument(
        "--curve-key-file",
        default="",
        metavar="PATH",
        help="this engine's CURVE key pair for the side channel (JSON, from trio-pd keygen)",
    )
    parser.add_argument(
        "--curve-peers-file",
        default="",
        metavar="PATH",
        help='public keys: {"consumers": [...]} a prefill engine lets in, '
        '{"producers": {"ENGINE_ID or *": key}} a decode engine expects',
    )
    parser.add_argument(
        "--no-curve",
        action="store_true",
        help="a plain-text side channel: anyone who reaches it may read every KV block (the "
        "default is CURVE: with the internal key, a key pair made at start and published in "
        "the signed etcd registration, or, without --etcd, one derived from the internal key; "
        "or the pair and peers of --curve-key-file/--curve-peers-file)",
    )
    parser.add_argument(
        "--prefill-url",
        action="append",
        default=[],
        metavar="URL",
        help="decode-first (--role decode): take clients' requests and run each one's "
        "prefill on one of these prefill engines (repeatable), its first token streamed as "
        "soon as the KV is held; kv_transfer_params from clients are refused",
    )
    parser.add_argument(
        "--no-prefill-channel",
        action="store_true",
        help="prefill requests over HTTP only: this engine opens no prefill channel for them "
        "(by default it does, on a port of its own that its prefill answers name), and, "
        "decode-first, sends them over HTTP (by default over a prefill engine's channel once "
        "connected: docs/serving.md)",
    )
    parser.add_argument(
        "--prefill-timeout",
        type=float,
        default=defaults.prefill_timeout,
        metavar="SECONDS",
        help="decode-first: each prefill request's deadline (default %(default)g)",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"decode-first: a client key, repeatable (default: ${API_KEY_ENV}); /v1/* then "
        "needs 'Authorization: Bearer KEY' (instead of the internal key, which the engine "
        "sends to its prefill engines); prefer the variable: flags show in ps",
    )
    add_etcd_arguments(
        parser,
        "register there once the engine accepts requests, withdraw first when it drains",
        "the registration's lease: a dead engine leaves etcd within it",
    )
    # trio-pd serve: drain when this process is no longer the parent.
    parser.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)


def settings_from_args(args: argparse.Namespace) -> EngineSettings:
    """The engine's settings (``engine_id`` may still be empty: derived once bound).

    Raises:
        UsageError: a bad flag.
    """
    max_model_len = args.max_model_len or min(
        MAX_MODEL_LEN, max(args.num_blocks, 1) * ModelConfig().block_size
    )
    settings = EngineSettings(
        engine_id=args.engine_id,
        http_port=args.port,
        side_channel_port=args.side_channel_port,
        host=args.host,
        advertise_host=args.advertise_host,
        num_blocks=args.num_blocks,
        ready_file=args.ready_file,
        tp_size=args.tp,
        max_model_len=max_model_len,
        grace=args.grace,
        send_timeout=args.send_timeout,
        lease_initial=args.lease_initial,
        admission_timeout=args.admission_timeout,
        prefill_urls=tuple(url.rstrip("/") for url in args.prefill_url),
        prefill_timeout=args.prefill_timeout,
        prefill_channel=not args.no_prefill_channel,
    )
    if settings.prefill_urls and args.role != "decode":
        raise UsageError("--prefill-url makes a decode engine decode-first: it needs --role decode")
    if settings.prefill_urls and args.etcd:
        # (registered as a decode engine, a proxy would send it decode
        # requests, which it refuses: it faces clients, not a proxy)
        raise UsageError("--prefill-url (decode-first) and --etcd: not together yet")
    if args.api_key and not settings.prefill_urls:
        raise UsageError("--api-key guards a decode-first engine's clients: it needs --prefill-url")
    try:
        settings.check()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return settings


def engine_curve(args: argparse.Namespace, key: str | None, etcd: bool) -> CurveAuth | None:
    """The side channel's CURVE keys: from the key files if given; else, with the
    internal key, a pair made now whose peers etcd's verified members publish
    (``etcd``), or the pair derived from the internal key; ``None`` only with
    ``--no-curve``.

    Raises:
        UsageError: no way to CURVE and no ``--no-curve``; or bad key files.
    """
    curve = curve_auth(args.curve_key_file, args.curve_peers_file, args.role)
    if curve is not None or args.no_curve:
        if curve is not None and args.no_curve:
            raise UsageError("--no-curve and --curve-key-file/--curve-peers-file contradict")
        return curve
    if key is None:
        raise UsageError(
            "the side channel would be plain text, open to anyone who reaches it: give the "
            f"internal key (--internal-key-file or ${INTERNAL_KEY_ENV}), or "
            "--curve-key-file/--curve-peers-file, or --no-curve"
        )
    if etcd:
        public, secret = generate_keypair()
        return CurveAuth(public_key=public, secret_key=secret, peers=PeerKeys())
    public, secret = deployment_keypair(key)
    return CurveAuth(
        public_key=public,
        secret_key=secret,
        allowed_consumers={public},
        producer_keys={ANY_ENGINE: public},
    )


def run(args: argparse.Namespace) -> int:
    """``trio-pd engine``: the exit status.

    Raises:
        UsageError: a bad flag.
    """
    settings = settings_from_args(args)
    key = internal_key(args.internal_key_file)
    membership = membership_from_args(args, key)
    curve = engine_curve(args, key, membership is not None)
    secret = exposure_secret(args.exposure_secret_file)
    if secret is None:
        print(
            f"trio-pd engine: WARNING: no exposure secret (${EXPOSURE_SECRET_ENV} or "
            "--exposure-secret-file): kv_transfer_params are not authenticated, so a decode "
            "engine pulls whatever blocks, engine and address a request names. Give every "
            "engine of the deployment the same secret.",
            file=sys.stderr,
            flush=True,
        )
    if key is None:
        print(
            f"trio-pd engine: WARNING: no internal key (${INTERNAL_KEY_ENV} or "
            "--internal-key-file): any client that reaches this engine may call /v1/* "
            "around the proxy. Give the engines and the proxy the same key.",
            file=sys.stderr,
            flush=True,
        )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    import torch  # (here: the proxy and serve import this module for its flags)

    torch.set_num_threads(1)
    clients = client_keys(args.api_key) if settings.prefill_urls else None
    if settings.prefill_urls and clients is None:
        print(
            f"trio-pd engine: WARNING: decode-first without client keys (${API_KEY_ENV} or "
            "--api-key): anyone who reaches this engine may call /v1/*.",
            file=sys.stderr,
            flush=True,
        )
    serving = functools.partial(
        serve_engine,
        settings,
        args.role,
        exposure_secret=secret,
        internal_keys=BearerKeys([key], audience="internal") if key else None,
        client_keys=clients,
        internal_key=key,
        curve=curve,
        membership=membership,
        parent_pid=args.parent_pid,
        freeze_heap=True,
    )
    try:
        trio.run(serving)
    except EngineStartError as exc:
        name = settings.engine_id or args.role
        print(f"trio-pd engine {name}: could not start: {exc}", file=sys.stderr, flush=True)
        return EXIT_USAGE if exc.status == EXIT_USAGE else EXIT_FAILED
    return EXIT_OK
