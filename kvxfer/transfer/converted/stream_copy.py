"""``stream_copy``: numpy's ``copyto`` for copies on one host, with streaming stores.

The compiled helper (``_stream_copy.c``) copies where it was built and an array's bytes are
rows of at least :data:`MIN_ROW_BYTES` contiguous on both sides; numpy's copy otherwise (the
same bytes, slower). :func:`native` says which.

Design: docs/design/host-reads.md#streaming-copies
"""

from __future__ import annotations

import ctypes
import functools
import logging

import numpy as np

log = logging.getLogger(__name__)

# Shorter rows: numpy's copy. Two threads copying random pieces of rows at a layer stride
# (torch's memory, 128 MiB, medians of 15): 16 KiB rows 13.2 ms numpy, 14.9 streamed;
# 32 KiB 12.7 / 12.1; 64 KiB 12.0 / 10.8; 128 KiB 11.4 / 9.9.
MIN_ROW_BYTES = 64 << 10


@functools.cache
def _library() -> ctypes.CDLL | None:
    try:
        from kvxfer.transfer.converted import _stream_copy  # type: ignore[attr-defined]
    except ImportError:  # not built: no C compiler at install time
        log.warning("kvxfer's streaming copy is not built (no C compiler was found when "
                    "kvxfer was installed): copies on this host use numpy's, which is "
                    "slower; reinstall kvxfer where `cc` and Python's headers are present")
        return None
    lib = ctypes.CDLL(_stream_copy.__file__)
    lib.kvxfer_copy_rows.restype = None
    lib.kvxfer_copy_rows.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_void_p,
                                     ctypes.c_ssize_t, ctypes.c_size_t, ctypes.c_size_t]
    lib.kvxfer_streaming.restype = ctypes.c_int
    return lib


def native() -> str:
    """How this process copies: ``"streaming"`` (the helper, streaming stores),
    ``"memcpy"`` (the helper, on a machine it has no streaming stores for) or ``"numpy"``
    (not built)."""
    lib = _library()
    if lib is None:
        return "numpy"
    return "streaming" if lib.kvxfer_streaming() else "memcpy"


def stream_copy(target: np.ndarray, source: np.ndarray) -> None:
    """``np.copyto(target, source)`` for arrays of one shape and dtype: by the helper in
    one call where they are rows of at least :data:`MIN_ROW_BYTES` contiguous on both
    sides (:func:`_rows`), with streaming stores on x86-64; anything else, numpy's copy,
    which also takes arrays that may overlap (the helper copies forward, numpy through
    a buffer) and dtypes holding references (the helper would copy them as bytes)."""
    lib = _library()
    rows = None if lib is None or target.shape != source.shape \
        or target.dtype != source.dtype \
        else _rows(target.shape, target.strides, source.strides, target.itemsize)
    if lib is None or rows is None or target.dtype.hasobject or not target.flags.writeable \
            or np.may_share_memory(target, source):
        np.copyto(target, source)
        return
    row_bytes, count, target_step, source_step = rows
    lib.kvxfer_copy_rows(target.ctypes.data, target_step, source.ctypes.data, source_step,
                         count, row_bytes)


@functools.lru_cache(maxsize=1024)
def _rows(shape: tuple[int, ...], target: tuple[int, ...], source: tuple[int, ...],
          itemsize: int) -> tuple[int, int, int, int] | None:
    """(row bytes, rows, target stride, source stride) for an array whose elements lie
    as rows contiguous on both sides, or None where they do not (rows too short, more
    than one outer dimension). As numpy's own copy does, dimensions of one are dropped,
    the rest taken in the target's memory order (a view's order may differ: a layer
    stride inside a head's), and neighbours that lie at matching strides on both sides
    merged. Cached: a read's pieces repeat a few shapes and strides, and the walk costs
    ~12 us after a large copy has left the interpreter's caches cold (measured: 18 us
    more per numpy copy, 8% of a TP split's read, before it was cached)."""
    dims = sorted(((n, t, s) for n, t, s in zip(shape, target, source, strict=True) if n != 1),
                  key=lambda dim: abs(dim[1]))
    merged: list[tuple[int, int, int]] = []
    for n, t, s in dims:  # innermost first: merge a dim into the one inside it
        if merged and t == merged[-1][0] * merged[-1][1] and s == merged[-1][0] * merged[-1][2]:
            inner = merged.pop()
            merged.append((inner[0] * n, inner[1], inner[2]))
        else:
            merged.append((n, t, s))
    n, t, s = merged[0] if merged else (1, itemsize, itemsize)
    if t != itemsize or s != itemsize or n * itemsize < MIN_ROW_BYTES or len(merged) > 2:
        return None
    count, target_step, source_step = merged[1] if len(merged) == 2 else (1, 0, 0)
    return n * itemsize, count, target_step, source_step
