"""The shared key of the KV side channel: read from a file, checked at start-up.

It signs side-channel messages, NIXL notifications and lease tickets (HMAC-SHA256); at least
:data:`MIN_KEY_BYTES` bytes. :func:`mode_problem` refuses a file that others may access or
its group may write; a group may read it only when root owns it.

Design: docs/design/net.md#the-kv-key
"""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

KV_KEY_ENV = "KVXFER_KV_KEY_FILE"
MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096


class KvKeyError(ValueError):
    """The key file cannot be used; the message names the file and what to do."""


def mode_problem(mode: int, owner_uid: int) -> str | None:
    """Why a key file with permission bits ``mode`` owned by ``owner_uid`` is unsafe
    (None: it is safe): others may not access it, its group may neither write nor execute
    it, and its group may read it only when root owns it (a Kubernetes Secret's
    ``root:<fsGroup>``, ``0440``), never when a user does (an accidental ``chmod 640``)."""
    bits = stat.S_IMODE(mode)
    if bits & 0o007:
        return "is accessible by others"
    if bits & 0o030:
        return "is writable or executable by its group"
    if bits & 0o040 and owner_uid != 0:
        return "is readable by its group but not owned by root"
    return None


def unsafe_mode(info: os.stat_result) -> str | None:
    """Why a key file with this ``stat`` is unsafe, with the fix (None: it is safe, or
    the platform has no POSIX modes)."""
    problem = None if sys.platform == "win32" else mode_problem(info.st_mode, info.st_uid)
    if problem is None:
        return None
    return (f"{problem} (mode {stat.S_IMODE(info.st_mode):04o}); run chmod 600 on it (only "
            f"a root-owned file may be group-readable, e.g. mode 0440 as Kubernetes mounts "
            f"a Secret with fsGroup)")


def load_kv_key(path: str | os.PathLike[str]) -> bytes:
    """The key in ``path``; :class:`KvKeyError` when it is missing, unreadable, unsafe
    by :func:`mode_problem` (POSIX), empty or shorter than :data:`MIN_KEY_BYTES` bytes."""
    where = Path(path)
    try:
        info = where.stat()
    except OSError as exc:
        raise KvKeyError(f"kv key file {str(where)!r} cannot be read: "
                         f"{exc.strerror or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise KvKeyError(f"kv key file {str(where)!r} is not a regular file")
    problem = unsafe_mode(info)
    if problem is not None:
        raise KvKeyError(f"kv key file {str(where)!r} {problem}")
    if info.st_size > MAX_KEY_BYTES:
        raise KvKeyError(f"kv key file {str(where)!r} has {info.st_size} bytes, at most "
                         f"{MAX_KEY_BYTES} are expected")
    try:
        key = where.read_bytes().strip()
    except OSError as exc:
        raise KvKeyError(f"kv key file {str(where)!r} cannot be read: "
                         f"{exc.strerror or exc}") from None
    if not key:
        raise KvKeyError(f"kv key file {str(where)!r} is empty")
    if len(key) < MIN_KEY_BYTES:
        raise KvKeyError(f"kv key file {str(where)!r} holds {len(key)} bytes, at least "
                         f"{MIN_KEY_BYTES} are needed (e.g. 64 hex digits from "
                         f"secrets.token_hex(32))")
    return key


def key_file_from(arg: str | None) -> str | None:
    """The key file to use: ``arg`` (the flag), else ``$KVXFER_KV_KEY_FILE``, else None."""
    if arg:
        return arg
    return os.environ.get(KV_KEY_ENV) or None
