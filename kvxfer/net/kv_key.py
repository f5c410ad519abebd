"""The shared key of the KV side channel: read from a file, checked at start-up.

Every prefill and decode instance that exchange KV caches share one key (``kvxfer
serve --kv-key-file PATH`` or ``$KVXFER_KV_KEY_FILE``). It signs every
side-channel message, every NIXL notification and every lease ticket
(HMAC-SHA256). The key is the file's content with surrounding whitespace removed,
at least :data:`MIN_KEY_BYTES` bytes; make one with
``python3 -c "import secrets; print(secrets.token_hex(32))" > kv.key; chmod 600 kv.key``.

Who may read it (:func:`mode_problem`): never others (world); never a group that
may write it. Group *read* is accepted only when root owns the file: then an
administrator chose that group on purpose, the way Kubernetes mounts a Secret
(``root:<fsGroup>``, ``defaultMode: 0440``). A group-readable file a user owns
is refused: that is the accidental ``chmod 640`` of a file in a shared group.
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
    (None: it is safe): see the module docstring."""
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
