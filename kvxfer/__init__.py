"""kvxfer: disaggregated KV-cache transfer for LLM inference.

Packages, one room each; each layer imports only the layers below it (``tests/test_layers.py``):

- ``plan``: pure planning: layouts, regions, TP topology, descriptors, conversions, pushes;
- ``net``: what every listener shares: addresses, interfaces, HTTP and KV keys;
- ``wire``: msgspec messages and their codecs, tickets, params, the decode's lease book;
- ``transfer``: one rank's machinery: the worker, reads, leases, pushes, NIXL, side channel;
- ``engine``: the reference engine (model, paged KV cache, scheduler, prefix cache);
- ``sidecar``: the HTTP sidecar: engine loop, connector and roles, OpenAI surface;
- ``vllm``: ``KvxferConnector``, vLLM's hooks onto the same transfer objects;
- ``harness``: loopback instances, network namespaces, synthetic ranks;
- ``commands``, ``cli``: the ``kvxfer`` command line; ``bench``: the benchmarks.

Design: docs/design/index.md
"""

__version__ = "0.1.0"
