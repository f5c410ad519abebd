"""What every listener shares, the sidecars' and the proxy's alike. Modules:

- ``hosts``: bind and advertise addresses, ``endpoint``, name resolution;
- ``interfaces``: which interface holds an address; UCX kept on it for a loopback instance;
- ``api_key``: HTTP API keys (``Authorization: Bearer``) for sidecars and proxy;
- ``kv_key``: the KV key file that signs the side channel, notifications and tickets.

Design: docs/design/net.md
"""
