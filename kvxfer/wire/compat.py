"""What two instances must agree on to exchange KV caches: :class:`CompatInfo` and its hash.

Every envelope carries the sender's compatibility hash (:func:`compat_hash`), and
usually its :class:`CompatInfo` too, so that a receiver with another hash can say
which fields differ (:func:`compat_diff`, :class:`~kvxfer.wire.protocol_errors.HashMismatch`).
"""

from __future__ import annotations

import hashlib

import msgspec

from kvxfer.plan.packing import TOKEN_PACKING, VLLM_CPU_PACKING_PREFIX
from kvxfer.wire.protocol_errors import FieldDiff, require
from kvxfer.wire.version import KVXFER_PROTOCOL_VERSION


class CompatInfo(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What two instances must agree on to exchange KV caches at all.

    Strings are canonical names chosen by the caller (dtypes without a
    ``torch.`` prefix, e.g. ``"bfloat16"``). ``total_kv_heads`` counts every KV
    head of the model, not one rank's share. TP size, block size and layout are
    deliberately absent: they may differ between the sides and are checked when
    descriptors are planned, with precise messages.

    ``kv_lora_rank`` is 0 for a cache of K and V heads. Above 0 the cache is an
    MLA latent one: per token one vector of ``head_size`` elements, the first
    ``kv_lora_rank`` the compressed KV and the rest the decoupled RoPE key, in a
    single head (``total_kv_heads == 1``) that every TP rank holds. Its bytes
    per token may equal some K/V cache's, so the two kinds must never pair.
    """

    model: str
    dtype: str
    cache_dtype: str
    head_size: int
    total_kv_heads: int
    num_layers: int
    kv_packing: str = TOKEN_PACKING  # see kvxfer.plan.packing
    kv_lora_rank: int = 0
    protocol_version: int = KVXFER_PROTOCOL_VERSION

    def __post_init__(self) -> None:
        for name in ("model", "dtype", "cache_dtype"):
            require(bool(getattr(self, name)), f"CompatInfo.{name} must not be empty")
        require(self.kv_packing == TOKEN_PACKING or (
            self.kv_packing.startswith(VLLM_CPU_PACKING_PREFIX)
            and len(self.kv_packing) > len(VLLM_CPU_PACKING_PREFIX)),
            f"CompatInfo.kv_packing must be {TOKEN_PACKING!r} or "
            f"'{VLLM_CPU_PACKING_PREFIX}<isa>', got {self.kv_packing!r}")
        for name in ("head_size", "total_kv_heads", "num_layers", "protocol_version"):
            value = getattr(self, name)
            require(value > 0, f"CompatInfo.{name} must be positive, got {value}")
        require(self.kv_lora_rank >= 0,
                f"CompatInfo.kv_lora_rank must not be negative, got {self.kv_lora_rank}")
        require(not self.kv_lora_rank or (self.kv_lora_rank < self.head_size
                                          and self.total_kv_heads == 1),
                f"CompatInfo of an MLA latent cache (kv_lora_rank {self.kv_lora_rank}) needs "
                f"total_kv_heads 1 (got {self.total_kv_heads}) and a head_size above the "
                f"rank, for the RoPE part (got {self.head_size})")


# What two peers may differ in and still exchange KV: a decode converts between the
# packings it knows (kvxfer.plan.staging); each rank's AgentMetadata says its own.
NEGOTIATED_FIELDS = ("kv_packing",)


def compat_hash(info: CompatInfo) -> str:
    """Hex SHA-256 of the canonical msgpack encoding of ``info``'s fields in declared
    order, :data:`NEGOTIATED_FIELDS` left out."""
    fields = [getattr(info, name) for name in CompatInfo.__struct_fields__
              if name not in NEGOTIATED_FIELDS]
    return hashlib.sha256(msgspec.msgpack.encode(fields)).hexdigest()


def compat_diff(here: CompatInfo, peer: CompatInfo) -> tuple[FieldDiff, ...]:
    """The fields on which ``here`` and ``peer`` differ, in declared order."""
    return tuple(FieldDiff(name, getattr(here, name), getattr(peer, name))
                 for name in CompatInfo.__struct_fields__
                 if name not in NEGOTIATED_FIELDS and getattr(here, name) != getattr(peer, name))

