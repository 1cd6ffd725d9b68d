"""CURVE authentication of the side channel: the ZAP handler.

Without it, anyone who can reach a producer's side channel receives its KV
cache's memory addresses and NIXL agent metadata, and can then read that
memory over RDMA. With :class:`CurveAuth` configured:

* the producer's listener is a CURVE server: traffic is encrypted, and a ZAP
  handler (a trio task of the connector) admits only consumers whose public
  key is in ``allowed_consumers``; others get no metadata at all;
* the consumer is a CURVE client that knows each producer's public key
  (``producer_keys``, by engine id, ``"*"`` for any) and so cannot be fooled
  by an impostor at the producer's address.

Keys are Z85 text, 40 characters, as :func:`generate_keypair` (or
``trio-pd keygen``) makes them. ZAP is ZeroMQ's authentication protocol
(RFC 27): libzmq sends each handshake's credentials to the socket bound at
``inproc://zeromq.zap.01`` in the same context and waits for a verdict.
"""

from __future__ import annotations

from collections.abc import Callable, Container

import trio
import zmq
import zmq.utils.z85

from trio_pd._side_channel._zmq import TrioZmqSocket

ZAP_ENDPOINT = "inproc://zeromq.zap.01"


def zap_verdict(frames: list[bytes], allowed: Container[str]) -> tuple[list[bytes], str | None]:
    """Decide one ZAP request (no I/O).

    Returns:
        ``(reply_frames, refusal)``: the ZAP reply, and ``None`` if the client
        was admitted or a one-line reason if not.
    """
    if len(frames) < 6:
        return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""], "malformed ZAP request"
    version, request_id, _domain, address, _identity, mechanism = frames[:6]
    credentials = frames[6:]
    refusal: str | None = None
    user = b""
    if mechanism != b"CURVE":
        refusal = f"mechanism {mechanism.decode(errors='replace')} is not CURVE"
    elif len(credentials) != 1 or len(credentials[0]) != 32:
        refusal = "malformed CURVE credentials"
    else:
        key = zmq.utils.z85.encode(credentials[0]).decode()
        if key in allowed:
            user = key.encode()
        else:
            refusal = f"consumer key {key} from {address.decode(errors='replace')} not allowed"
    status = (b"200", b"OK") if refusal is None else (b"400", b"not allowed")
    return [version, request_id, *status, user, b""], refusal


async def serve_zap(
    context: zmq.Context[zmq.Socket[bytes]],
    allowed: Container[str],
    on_refusal: Callable[[str], None],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Answer ZAP requests for ``context`` until cancelled (socket closed on exit).

    Must be started (``nursery.start``) before the CURVE listener binds, so no
    handshake finds the handler missing.
    """
    socket = TrioZmqSocket(context.socket(zmq.REP))
    async with socket:
        socket.zmq_socket.setsockopt(zmq.LINGER, 0)
        socket.zmq_socket.bind(ZAP_ENDPOINT)
        task_status.started()
        while True:
            frames = await socket.receive_multipart()
            reply, refusal = zap_verdict(frames, allowed)
            if refusal is not None:
                on_refusal(refusal)
            await socket.send_multipart(reply)
