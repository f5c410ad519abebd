"""A kvxfer sidecar: one engine behind an OpenAI-compatible HTTP API, and the roles it
plays in KV transfers. Modules and packages:

- ``http_app``: the FastAPI app and ``serve``, the uvicorn server with its drain;
- ``handlers``: the routes; ``answer``: a request's answer, whole or streamed;
- ``openai_api/``: validation of OpenAI bodies and ``kv_transfer_params``;
- ``instance``: ``Sidecar``, one instance's engine, roles, loop and metrics;
- ``kv_event_publisher``: the KV event stream, what the prefix cache holds, in vLLM's format;
- ``engine_loop``: ``EngineLoop``, the one thread that owns the engine and the roles;
- ``request_kinds``: what a request asks of the transfers, one class per kind;
- ``roles/``: the prefill side, the pull decode, the push decode, and their composition;
- ``settings``: ``Settings``, what ``kvxfer serve`` configures (transfers: one
  ``TransferConfig``);
- ``sidecar_metrics``: the instance's Prometheus metrics.

Design: docs/design/sidecar-roles.md
"""
