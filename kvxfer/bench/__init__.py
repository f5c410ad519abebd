"""The benchmarks behind ``kvxfer bench``: commands that print numbers (and JSON), never
assertions on wall time. Modules:

- ``transfer``, ``push``, ``nixl``, ``descriptor_cost``: one request's KV between two
  processes; pushed vs pulled; the NIXL agent's costs; building descriptor lists;
- ``serving``, ``ttft``, ``prefix``, ``trust``: sidecars of the reference engine; time to
  first token next to one instance; the prefix cache; what signing costs;
- ``proxy``, ``hop``, ``load``: the proxy's added latency, its floor, load through it;
- ``fleet``, ``index_cost``: routing policies and aggregated serving under multi-turn chats;
  what the proxy's KV index costs;
- ``soak``: mixed load under injected faults, every answer checked;
- ``vllm``: NixlConnector vs KvxferConnector in real vLLM;
- ``children``, ``affinity``: server processes a benchmark starts; threads that left
  their cores.

Design: docs/design/bench.md
"""
