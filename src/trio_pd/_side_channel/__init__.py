"""The side channel: its seam, and its ZeroMQ transport's trio shells.

The seam (``_seam``): what the roles need from the side channel, as whole
messages -- a consumer's request to a producer rank, answered with one
reply; the producer's listener, which turns each request into its reply;
the consumers' confirmations. ``open_connector(..., side_channel=...)``
takes a factory of it; the in-memory one is ``trio_pd.testing``'s.

ZeroMQ behind it (``_zmq_channel``: the default, which owns the context and
the listener's ROUTER socket): the trio adapter for ZeroMQ sockets
(``_zmq``), a request's rounds on fresh DEALER sockets and the metadata
step of a handshake with its diagnosis (``_fetch``), CURVE keys and the ZAP
handler (``_auth``), and the consumer's confirmations (``_confirm``: what
a pull sends and concludes, shared, and the ZeroMQ channels: one
long-lived DEALER per producer rank, batching). Owns the sockets it opens
and closes them on every exit path. May import ``_core``; what the
listener answers is the producer's (``_producer``).
"""
