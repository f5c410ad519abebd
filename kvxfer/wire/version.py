"""What marks kvxfer's bytes on the wire: :data:`MAGIC` and :data:`KVXFER_PROTOCOL_VERSION`.

Every handshake message (:mod:`kvxfer.wire.envelope`) and every NIXL notification
(:mod:`kvxfer.wire.notification`) starts with the magic, then the version; a receiver
refuses another version before it looks at anything else (:mod:`kvxfer.wire.framing`).

Where the version is sent or checked it is read as ``version.KVXFER_PROTOCOL_VERSION``
(this module's attribute, not a copy bound at import), so that one name says which
version this process speaks.
"""

from __future__ import annotations

# Version history; bump on every change of the bytes on the wire (envelope,
# messages, notifications, RegionPlan and its parts, the signed bytes).
#   1: first version: MAGIC + msgpack Envelope {version, compat_hash, kind,
#      payload, signature, sender}; MetadataRequest / MetadataResponse /
#      ErrorReply payloads; AgentMetadata carries a RegionPlan; ReadDone
#      notifications as MAGIC + msgpack {version, done}.
#   2: message kinds "release" (ReleaseLease, decode -> prefill) and "release_ack"
#      (ReleaseAck); neither has its compat hash checked.
#   3: signed envelopes carry a timestamp and a random nonce (both signed) so that
#      a receiver refuses replays; notifications carry an optional HMAC signature;
#      message kinds "renew" (RenewLease) and "renew_ack" (RenewAck), hash-free.
#   4: RenewLease.claim (a decode claims a lease before its first READ; the prefill
#      records the claimer and refuses every other engine) and RenewAck.reason.
#   5: CompatInfo.kv_packing (how K and V share a head's block: per token, as the
#      reference engine keeps them, or as vLLM's CPU attention kernels store them).
#   6: CompatInfo.kv_lora_rank (0: K and V heads; > 0: an MLA latent cache) and
#      RegionPlan.latent.
#   7: AgentMetadata.backends (the NIXL backends the rank's agent runs) and
#      AgentMetadata.kv_packing; CompatInfo.kv_packing no longer enters the compat hash
#      (peers with different packings talk, the decode converts).
#   8: RegionPlan.kernel_ratio and AgentMetadata.kernel_ratio: a rank's views may see each
#      logical block (what block ids count, block_size) as kernel_ratio kernel blocks,
#      the blocks its regions address; ids stay logical on the wire.
#   9: AgentMetadata.host_reads (HostReads): a prefill rank offers that a decode on its
#      host copies converted reads straight from its memory (kvxfer.transfer.converted.host_reads).
#  10: HostReads.memory (SharedRegion): the shared buffers (memfds) the rank's cache lies
#      in, which a decode on its host may map (kvxfer.transfer.converted.mapped_reads).
#  11: message kind "done" (DoneReport, hash-free): a decode rank's "done" over the side
#      channel, acknowledged with a ReleaseAck, next to its NIXL notification;
#      ReleaseLease.outcome ("abandoned", "cached": a full prefix-cache hit).
#  12: ReleaseLease.outcome "answered": the first token the prefill sampled (its
#      kv_transfer_params.first_token) ended the request, so the decode read nothing.
#  13: HostReads.proof_addr and HostReads.handover: a reader takes a shared buffer's
#      descriptor over the prefill's abstract Unix socket, proving it may read the prefill's
#      memory (kvxfer.transfer.converted.fd_handover), no longer with pidfd_getfd; SharedRegion.fd
#      becomes SharedRegion.id, a buffer id (the descriptor is not in the prefill's fd table).
#      Message kinds "heartbeat" (Heartbeat, decode -> prefill, while a READ from it is in
#      flight) and "heartbeat_ack" (HeartbeatAck), both hash-checked.
#  14: RenewLease.claimer_host and .claimer_port: a prefill claiming a decode's reservation
#      (push mode) names its own side channel; HeartbeatAck.engine_id: who answers there
#      (a decode asks so whether a claimer still runs, kvxfer.sidecar.roles.claimers).
#  15: Reservation.cached_tokens (signed): a decode's prefix cache holds a prompt's first
#      tokens; the reservation's blocks, the only ones a prefill writes, start after them.
KVXFER_PROTOCOL_VERSION: int = 15

MAGIC = b"KVXF"
"""The first four bytes of every kvxfer handshake message and notification."""
