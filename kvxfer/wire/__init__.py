"""What travels between instances: msgspec types and their codecs (pure: no I/O). Modules:

- ``version``: the magic and the protocol version, with its history;
- ``framing``: what every frame shares: magic, version, strict msgpack, HMAC signatures;
- ``envelope``: the signed envelope of side-channel messages, decoded in two phases;
- ``messages``: the side channel's messages and their kinds;
- ``metadata``: a rank's ``AgentMetadata``, what a decode needs to READ from it;
- ``compat``: what two instances must agree on (``CompatInfo``) and its hash;
- ``notification``: the NIXL "done" (``ReadDone``);
- ``replay``: refusing replayed signed messages;
- ``protocol_errors``: ``SideChannelError`` and the protocol's errors;
- ``tickets``: signed lease tickets; ``reservations``: a decode's signed reservation;
- ``params``: ``RemoteParams``, the ``kv_transfer_params`` a decode request carries;
- ``lease_book``: the decode's view of the leases it reads.

Design: docs/design/side-channel.md, docs/design/leases.md
"""
