"""The ZMQ side channel over which a decode instance learns a prefill's NIXL metadata,
and over which it claims, renews and releases the prefill's leases.

The only package that imports ZMQ. Wire format and validation live in :mod:`kvxfer.wire`
(:mod:`~kvxfer.wire.envelope`, :mod:`~kvxfer.wire.messages`, :mod:`~kvxfer.wire.protocol_errors`).

* Prefill side: one :class:`~kvxfer.transfer.side_channel.listener.SideChannelListener` per
  instance, a ROUTER socket served by a background thread, answers a
  :class:`MetadataRequest` with the :class:`AgentMetadata` of the requested local TP
  ranks, and a :class:`ReleaseLease` with a :class:`ReleaseAck` after handing it to its
  ``on_release`` callback. Whatever a peer sends (garbage, wrong frame counts, another
  version or model, a bad signature, unknown ranks) is logged with the peer's address and
  identity and answered with an :class:`ErrorReply`; the listener keeps serving. A release
  from another model is served: it carries no KV metadata (see
  :data:`~kvxfer.wire.messages.HASH_FREE_KINDS`).
* Decode side: :meth:`SideChannelClient.fetch
  <kvxfer.transfer.side_channel.client.SideChannelClient.fetch>` sends one request over a
  fresh DEALER socket per attempt (so a late answer to an abandoned attempt can never be
  mistaken for the current one), waits up to ``timeout`` seconds per attempt, retries only
  timeouts, and raises a :class:`~kvxfer.wire.protocol_errors.SideChannelError` naming the peer
  address on any failure. ``SideChannelClient.release`` sends one release the same way,
  with one attempt. :class:`~kvxfer.transfer.side_channel.sender.SideChannelSender`
  sends releases (and renewals) from a background thread, best effort, so that no caller
  waits on a peer. :class:`~kvxfer.transfer.side_channel.heartbeats.Heartbeats` asks the
  prefills that READs are in flight from whether they still answer (a
  :class:`Heartbeat`, from one thread that never waits on a peer), so that a silent one
  fails those READs within a bound (:mod:`kvxfer.transfer.liveness`).
* Both: :mod:`~kvxfer.transfer.side_channel.sockets` (addresses, sockets, limits) and
  :mod:`~kvxfer.transfer.side_channel.failures` (what failed, in one word for metrics).

Frames: the client sends exactly one frame (the encoded envelope) and receives
exactly one. The listener also answers REQ sockets, whose empty delimiter
frame it echoes.
"""
