"""A decode rank's reads: one ``Read`` per request, moved by the paths its peer's plans call
for, driven by the ``Reader`` on the worker's thread. Modules:

- ``read``: ``Read``, what every path of one request's read shares;
- ``path``: ``ReadPath``, the interface every way of moving bytes implements;
- ``direct``, ``over_lanes``: NIXL READs into place, alone or split over read lanes;
- ``staged``: READs into staging, placed by the converter thread;
- ``host``: copies on this host (``HostPath``, ``MappedPath``);
- ``reader``: ``Reader``, a rank's reads from queued to reported.

Design: docs/design/reads.md
"""
