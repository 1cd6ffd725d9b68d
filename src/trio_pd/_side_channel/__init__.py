"""The ZeroMQ side channel's trio shells: sockets, CURVE, request/reply clients.

The trio adapter for ZeroMQ sockets (``_zmq``), the fetch of an engine's
metadata with its diagnosis (``_fetch``), CURVE keys and the ZAP handler
(``_auth``), and the consumer's confirmation channels (``_confirm``: one
long-lived DEALER per producer rank). Owns the sockets it opens and closes
them on every exit path. May import ``_core``; the listener that answers
requests is the producer's (``_producer``).
"""
