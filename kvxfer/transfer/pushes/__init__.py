"""Push mode, a prefill rank's side: WRITEs of a request's KV into a decode's reservation.
Modules:

- ``targets``: ``Targets``, the decode engines it pushes into, handshaken and connected;
- ``pusher``: ``Pusher``, each request's WRITEs, layer group by layer group, and its signed
  "done".

The decode's side is a lease held on its own blocks (``LeaseTable``), ended by the writers'
"done".

Design: docs/design/push.md
"""
