"""``trio-pd`` / ``python -m trio_pd``: the command line.

``trio-pd demo`` runs a small real P/D deployment on this machine (see
``trio_pd._cli.demo``): prefill engines in their own processes, a decode engine
and a stand-in for the P/D proxy in this one. Every pulled byte is
verified; the exit status is non-zero if any byte differs, or if a request
failed without an injected fault.

``trio-pd engine`` runs one prefill or decode engine of the tiny model of
``trio_pd._serve`` (an HTTP server, see ``trio_pd._cli.engine``);
``trio-pd proxy`` the P/D proxy in front of such engines
(``trio_pd._cli.proxy``); ``trio-pd serve`` a whole deployment on one host,
built from the two (``trio_pd._cli.serve``). Their exit statuses: 0 after a
clean drain, 1 when something could not start or an engine failed, 2 for
bad arguments (one line on stderr, never a traceback).

``trio-pd keygen`` prints a new CURVE key pair for side-channel authentication.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import attrs
import trio
from rich.console import Console

from trio_pd._cli import engine as engine_command
from trio_pd._cli import proxy as proxy_command
from trio_pd._cli.common import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    add_address_arguments,
    add_admission_argument,
    add_dispatch_argument,
    add_internal_key_argument,
    add_lease_argument,
    add_send_timeout_argument,
    client_keys,
    internal_key,
)
from trio_pd._cli.demo import DemoOptions, format_summary, run_demo
from trio_pd._cli.serve import ServeError, ServeOptions, run_serve
from trio_pd._curve_keys import generate_keypair
from trio_pd._harness._netns import TestHostsUnavailable
from trio_pd._serve.keys import API_KEY_ENV


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trio-pd")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser(
        "demo",
        help="run a small verified P/D deployment",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,  # (--help shows the sizes)
    )
    defaults = DemoOptions()
    demo.add_argument(
        "--prefill-engines",
        type=int,
        default=defaults.prefill_engines,
        metavar="N",
        help="prefill engines, each in its own process(es)",
    )
    demo.add_argument(
        "--requests", type=int, default=defaults.requests, metavar="N", help="requests to run"
    )
    demo.add_argument(
        "--regions",
        type=int,
        default=defaults.regions,
        metavar="N",
        help="KV regions (layers x K/V)",
    )
    demo.add_argument(
        "--blocks", type=int, default=defaults.blocks, metavar="N", help="blocks per region"
    )
    demo.add_argument(
        "--block-bytes",
        type=int,
        default=defaults.block_bytes,
        metavar="BYTES",
        help="bytes per block per region",
    )
    demo.add_argument(
        "--max-prompt-blocks",
        type=int,
        default=defaults.max_prompt_blocks,
        metavar="N",
        help="each request pulls 1 to N blocks (per region), drawn at random",
    )
    demo.add_argument(
        "--concurrency",
        type=int,
        default=defaults.concurrency,
        metavar="N",
        help="requests in flight at once",
    )
    demo.add_argument(
        "--seed",
        type=int,
        default=defaults.seed,
        metavar="N",
        help="seeds the prompt sizes and the block contents (a run repeats with the same seed)",
    )
    demo.add_argument(
        "--slow-engine-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="add this one-way latency in front of prefill-0's side channel",
    )
    demo.add_argument(
        "--kill-engine-after",
        type=int,
        default=0,
        metavar="N",
        help="kill the last prefill engine at its first request from the N-th on, after its "
        "prefill and before the decode pulls it",
    )
    demo.add_argument(
        "--prefill-tp",
        type=int,
        default=defaults.prefill_tp,
        metavar="N",
        help="tensor-parallel size of each prefill engine (N processes each)",
    )
    demo.add_argument(
        "--decode-tp",
        type=int,
        default=defaults.decode_tp,
        metavar="M",
        help="tensor-parallel size of the decode engine (M connectors)",
    )
    demo.add_argument(
        "--hosts",
        type=int,
        default=defaults.hosts,
        metavar="N",
        help="run the prefill engines in N test hosts (network namespaces, root only), "
        "UCX over TCP",
    )
    demo.add_argument("--json", action="store_true", help="print the summary as JSON")
    engine = commands.add_parser(
        "engine", help="one prefill or decode engine of the tiny model (an HTTP server)"
    )
    engine_command.add_arguments(engine)
    proxy = commands.add_parser("proxy", help="the P/D proxy in front of engines")
    proxy_command.add_arguments(proxy)
    serve = commands.add_parser(
        "serve",
        help="serve the tiny model over HTTP: prefill and decode engines behind a proxy (or, "
        "--dispatch decode-first, decode engines that clients call)",
    )
    serving = ServeOptions()
    serve.add_argument(
        "--prefill",
        type=int,
        default=serving.prefill,
        metavar="N",
        help="prefill engines, each a trio-pd engine process",
    )
    serve.add_argument(
        "--decode",
        type=int,
        default=serving.decode,
        metavar="M",
        help="decode engines, each a trio-pd engine process",
    )
    serve.add_argument(
        "--prefill-tp",
        type=int,
        default=serving.prefill_tp,
        metavar="N",
        help="tensor-parallel size of each prefill engine (one connector per rank)",
    )
    serve.add_argument(
        "--decode-tp",
        type=int,
        default=serving.decode_tp,
        metavar="M",
        help="tensor-parallel size of each decode engine",
    )
    add_address_arguments(
        serve,
        host=serving.host,
        binds="where every server binds",
        advertise="the address the servers are dialled at (default: --host; 127.0.0.1 for a "
        "wildcard)",
        port=serving.port,
        port_help="the proxy's port (0: any free port); decode-first, the first decode "
        "engine's, the others' following it",
    )
    serve.add_argument(
        "--ready-file",
        default="",
        metavar="PATH",
        help='{"dispatch": ..., "clients": [urls], "proxy": url, "prefill": [urls], "decode": '
        "[urls]}, written once every engine and the proxy accept requests; removed on exit; "
        '"clients" is what clients call: [the proxy], or decode-first the decode engines (and '
        '"proxy" is null)',
    )
    serve.add_argument(
        "--grace",
        type=float,
        default=serving.grace,
        metavar="SECONDS",
        help="seconds the proxy, then each engine, drains on SIGINT/SIGTERM (decode-first: "
        "the decode engines, then the prefill engines)",
    )
    add_send_timeout_argument(serve, serving.send_timeout)
    add_lease_argument(serve, serving.lease_initial)
    add_admission_argument(serve, serving.admission_timeout)
    add_dispatch_argument(serve, serving.dispatch, decode_first=True)
    serve.add_argument(
        "--num-blocks",
        type=int,
        default=serving.num_blocks,
        metavar="N",
        help="KV blocks in each engine's pool",
    )
    serve.add_argument(
        "--hosts",
        type=int,
        default=serving.hosts,
        metavar="N",
        help="run the engines on N test hosts (network namespaces, root only), "
        "found by the proxy through an etcd run here: the cluster's shape on one machine "
        "(not with --dispatch decode-first)",
    )
    serve.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help=f"a client key for the proxy, repeatable (default: ${API_KEY_ENV}); /v1/* "
        "then needs 'Authorization: Bearer KEY'; the engines get an internal key, so clients "
        "reach them only through the proxy (decode-first: the decode engines take the client "
        "keys, in their environment, and the prefill engines the internal key alone)",
    )
    add_internal_key_argument(
        serve,
        "for the engines; without it, one made for this run (tools that call an engine "
        "directly give their own)",
    )
    serve.add_argument(
        "--no-curve",
        action="store_true",
        help="plain-text side channels (default: CURVE, every engine with a key pair made for "
        "this run, the prefill engines letting only the decode engines in)",
    )
    serve.add_argument(
        "--no-prefill-channel",
        action="store_true",
        help="the engines send and take prefill requests over HTTP only (by default a "
        "decode-first engine sends them over its prefill engines' prefill channels: "
        "docs/serving.md)",
    )
    serve.add_argument(
        "--etcd-ttl",
        type=float,
        default=serving.etcd_ttl,
        metavar="SECONDS",
        help="with --hosts: each engine's etcd lease (a dead engine leaves within it)",
    )
    commands.add_parser(
        "keygen",
        help="print a new CURVE key pair (JSON) for ConnectorConfig(auth=CurveAuth(...))",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.command == "keygen":
        public, secret = generate_keypair()
        print(json.dumps({"public_key": public, "secret_key": secret}))
        return
    # NIXL logs every agent creation at INFO on stdout; keep the summary readable
    # (prefill workers inherit this).
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if args.command in ("engine", "proxy", "serve"):
        sys.exit(_serving_command(args))
    options = DemoOptions(
        prefill_engines=args.prefill_engines,
        requests=args.requests,
        regions=args.regions,
        blocks=args.blocks,
        block_bytes=args.block_bytes,
        max_prompt_blocks=args.max_prompt_blocks,
        concurrency=args.concurrency,
        seed=args.seed,
        slow_engine_delay=args.slow_engine_delay,
        kill_engine_after=args.kill_engine_after,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        hosts=args.hosts,
        progress=not args.json,
    )
    try:
        options.check()
    except ValueError as exc:
        sys.exit(f"trio-pd demo: {exc}")
    if args.json:  # stdout is for the JSON alone: what else prints (UCX's C code) goes to stderr
        sys.stdout.flush()
        json_out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    try:
        summary = trio.run(run_demo, options)
    except TestHostsUnavailable as exc:
        sys.exit(f"trio-pd demo --hosts: {exc}")
    if args.json:
        with json_out:
            json_out.write(json.dumps(summary, indent=2) + "\n")
    else:
        print(format_summary(summary))
    sys.exit(EXIT_OK if summary["verified"] else EXIT_FAILED)


def _serving_command(args: argparse.Namespace) -> int:
    """Run ``trio-pd engine``, ``proxy`` or ``serve``: the exit status."""
    try:
        if args.command == "engine":
            return engine_command.run(args)
        if args.command == "proxy":
            return proxy_command.run(args)
        return _serve(args)
    except UsageError as exc:
        print(f"trio-pd {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _serve(args: argparse.Namespace) -> int:
    serving = ServeOptions(
        prefill=args.prefill,
        decode=args.decode,
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        host=args.host,
        advertise_host=args.advertise_host,
        port=args.port,
        ready_file=args.ready_file,
        grace=args.grace,
        send_timeout=args.send_timeout,
        lease_initial=args.lease_initial,
        admission_timeout=args.admission_timeout,
        num_blocks=args.num_blocks,
        hosts=args.hosts,
        etcd_ttl=args.etcd_ttl,
        api_keys=client_keys(args.api_key),
        curve=not args.no_curve,
        prefill_channel=not args.no_prefill_channel,
        dispatch=args.dispatch,
    )
    if key := internal_key(args.internal_key_file):
        serving = attrs.evolve(serving, internal_key=key)
    try:
        serving.check()
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        trio.run(run_serve, serving, Console(stderr=True))
    except ServeError as exc:
        print(f"trio-pd serve: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


if __name__ == "__main__":
    main()
