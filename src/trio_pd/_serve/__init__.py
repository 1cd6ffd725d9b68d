"""Serving: the engine server and the P/D proxy over HTTP, on trio (an application of the library).

What a trio-based serving frontend builds around a connector, small enough
to read in one sitting. By concept:

* the engine: ``engine`` (the server: the tiny model, its paged KV cache,
  its connectors), ``app`` (its ASGI application and the lifespan that owns
  the connectors), ``model`` (a tiny Llama-style transformer, no I/O),
  ``pool`` (the KV-cache block pool), ``process`` (one engine process under
  hypercorn's trio worker);
* the proxy: ``proxy`` (prefill on one engine, decode on another; its HTTP
  client and per-phase deadlines), ``routing`` (which engine gets a request,
  no I/O), ``discovery`` (where a membership service such as etcd plugs into
  the engine and the proxy), ``dispatch`` (concurrent dispatch's two-line
  decode requests: the proxy writes them, the engine reads them),
  ``prefilling`` (a prefill request to a prefill engine and its answer:
  the proxy's, and a decode-first engine's, which runs its requests'
  prefill itself), ``prefill_channel`` (the same prefill requests over
  a kept TCP connection: a prefill engine's listener, a decode-first
  engine's connections);
* the HTTP surface both share: ``openai``, ``fields`` and ``responses``
  (OpenAI-compatible requests and bodies, vLLM's ``kv_transfer_params``;
  no I/O), ``errors`` (one table from exceptions to HTTP answers), ``keys``
  (bearer keys), ``asgi`` (the little ASGI both need), ``binding``
  (listening sockets, advertised addresses, ready files), ``stopping``
  (signals and drains), ``heap`` (the start-up heap frozen out of the
  garbage collector's way), ``timing`` (``Server-Timing``), ``metrics``
  (Prometheus), ``defaults`` (the deadlines, chosen together), ``ports``
  (free ports).

May import the library's public names and ``_core``, ``_side_channel``,
``_connector``, ``_config`` and ``_membership`` (lazily, through
``discovery``); never ``_harness``. The command line (``_cli``) runs it.
"""
