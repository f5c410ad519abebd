"""Pure planning: no I/O, tested without NIXL. Modules:

- ``layout``: the layout vocabulary, ``KVCacheLayout``, ``CacheSpec``, ``reshape_kv_cache``;
- ``packing``: how K and V share a head's block (``kv_views``);
- ``regions``: views into memory registrations and transfer regions;
- ``topology``: which prefill ranks and heads each decode rank reads;
- ``pairing``: which token of one side's blocks pairs with which of the other's;
- ``descriptors``: vectorised, minimal descriptor lists for a request;
- ``staging``: converted reads: READ into staging, then place;
- ``pushes``: what a prefill rank WRITEs into each decode rank (push mode);
- ``span_probe``: a read's ceiling, its bytes in as few descriptors as memory allows.

Design: docs/design/plan.md
"""
