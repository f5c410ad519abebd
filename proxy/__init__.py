"""The kvxfer proxy: one OpenAI-compatible endpoint in front of prefill and decode sidecars.

Each completion request goes to a prefill instance (one token, KV leased), then
to a decode instance with the prefill's ``kv_transfer_params``; the decode's
answer, streamed or not, goes back to the client. Modules, one concept each:

- ``config``: instance URLs, policy, timeouts (``ProxyConfig``);
- ``contract``: the sidecars' request/answer contract (pure);
- ``balancer``: instance state and the kv_aware / round_robin / least_outstanding policies,
  and when a decode alone answers;
- ``event_streams``, ``kv_index``: the instances' KV event streams, and what each caches;
- ``prompts``: a request's prompt tokens, for kv_aware's scores;
- ``pd_watch``: the alarm when a decode reads no KV (P/D not happening);
- ``upstream``: calls to one instance and how their failures are reported;
- ``router``: one request through prefill then decode, with failover;
- ``fanout``: several prompts in one request, one prefill/decode pair each;
- ``discovery``: instances by DNS name, re-resolved, joining and retiring;
- ``errors``: the errors the proxy answers with, in the OpenAI shape;
- ``relay``: client disconnects and unbuffered stream relaying;
- ``health``: the background health checker;
- ``middleware``: request ids, API key, request metrics;
- ``metrics``: the app's Prometheus registry;
- ``app`` / ``server``: ``create_app(config)`` and ``serve(config)``;
- ``stub``: a stand-in sidecar for tests and ``kvxfer bench proxy``.

Heavy imports stay in the submodules; ``import proxy`` is cheap.

Design: docs/design/proxy.md
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from proxy.config import ConfigError, ProxyConfig

if TYPE_CHECKING:
    from proxy.app import create_app
    from proxy.server import serve

__all__ = ["ConfigError", "ProxyConfig", "create_app", "serve"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from proxy.app import create_app
        return create_app
    if name == "serve":
        from proxy.server import serve
        return serve
    raise AttributeError(f"module 'proxy' has no attribute {name!r}")
