"""The ZMQ side channel: handshakes (NIXL metadata), lease claims, renewals and releases,
"done" reports and heartbeats. The only package that imports ZMQ; the wire format is
:mod:`kvxfer.wire`'s. Modules:

- ``listener``: ``SideChannelListener``, one per instance, answers every message kind;
- ``client``: ``SideChannelClient``, one request per fresh DEALER socket;
- ``sender``: ``SideChannelSender``, releases, renewals, claims and reports from one thread;
- ``reports``: ``Reports``, the one sender of an instance's "done" reports and releases;
- ``heartbeats``: ``Heartbeats``, the decode's heartbeat thread;
- ``sockets``: what both ends share: sockets, limits, waits;
- ``failures``: how talking to a peer fails, in one word for metrics.

Design: docs/design/side-channel.md
"""
