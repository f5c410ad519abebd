"""``stream_copy``: the same bytes as numpy's copy, through the compiled helper where the
arrays are rows it can take, and the helper built wherever a C compiler is."""

from __future__ import annotations

import functools
import logging
import shutil
import sys

import numpy as np
import pytest

from kvxfer.transfer.converted import stream_copy as sc


def test_the_helper_is_built_where_a_c_compiler_is() -> None:
    """`pip install` (dev.py's setup) builds it; a broken build would silently fall back to
    numpy's slower copy, so where a compiler exists its absence is a failure here."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        assert sc.native() == "numpy"
        return
    expected = "streaming" if _x86_64() else "memcpy"
    assert sc.native() == expected


def _x86_64() -> bool:
    import platform

    return platform.machine() in ("x86_64", "AMD64")


# (target shape, target slice, source shape, source slice): rows of every kind the
# mapped reads copy, and shapes the helper must leave to numpy
CASES = [
    ((1 << 16,), np.s_[:], (1 << 16,), np.s_[:]),  # one contiguous piece
    ((1 << 16,), np.s_[3:3 + 40001], (1 << 16,), np.s_[7:7 + 40001]),  # odd, misaligned
    ((8, 4, 16384), np.s_[:, :2], (8, 4, 16384), np.s_[:, 2:]),  # rows at strides
    ((3, 8, 4, 16384), np.s_[:, :, 1:3], (3, 9, 4, 16384), np.s_[:, :8, :2]),  # numpy
    ((3, 8, 4, 16384), np.s_[:, :, 1:3], (3, 8, 4, 16384), np.s_[:, :, :2]),  # one call
    ((64, 64), np.s_[:, :8], (64, 64), np.s_[:, 8:16]),  # rows too short: numpy
    ((1, 32, 1, 32768), np.s_[:], (2, 32, 1, 32768), np.s_[1:]),  # dims of one dropped
    ((4, 65536), np.s_[::-1], (4, 65536), np.s_[:]),  # negative strides
]


@pytest.mark.parametrize(("tshape", "tslice", "sshape", "sslice"), CASES)
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32])
def test_a_copy_places_exactly_what_numpys_does(tshape: tuple[int, ...], tslice: object,
                                                sshape: tuple[int, ...], sslice: object,
                                                dtype: type) -> None:
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    source = rng.integers(info.min, info.max, sshape, dtype=dtype, endpoint=True)
    target = rng.integers(info.min, info.max, tshape, dtype=dtype, endpoint=True)
    expected = target.copy()
    np.copyto(expected[tslice], source[sslice])  # type: ignore[index]
    sc.stream_copy(target[tslice], source[sslice])  # type: ignore[index]
    assert np.array_equal(target, expected)  # the slice placed, nothing else touched


def test_rows_are_found_where_the_helper_can_copy_them() -> None:
    """The one call the helper gets: (row bytes, rows, target stride, source stride), dims
    taken in memory order and merged where both sides allow."""
    head = 16384 * 2
    a = np.zeros((3, 8, 4, 16384), np.int16)
    target, source = a[:, :, 1:3], np.zeros((3, 8, 4, 16384), np.int16)[:, :, :2]
    # the outer dims lie at matching strides on both sides: one walk of 24 rows
    assert _rows(target, source) == (2 * head, 24, 4 * head, 4 * head)
    source = np.zeros((3, 9, 4, 16384), np.int16)[:, :8, :2]  # they do not: two outer dims
    assert _rows(target, source) is None
    # a view whose order is not its memory order (a layer stride inside a head's, BHLNC):
    # taken in memory order, one contiguous piece
    bhl = np.zeros((8, 32, 4096), np.int16).transpose(1, 0, 2)
    assert _rows(bhl, np.zeros((32, 8, 4096), np.int16)) is None  # the orders differ
    assert _rows(bhl, np.zeros((8, 32, 4096), np.int16).transpose(1, 0, 2)) == (
        8 * 32 * 4096 * 2, 1, 0, 0)
    short = np.zeros((64, 1024), np.uint8)[:, :512]
    assert _rows(short, short) is None  # rows under MIN_ROW_BYTES


def _rows(target: np.ndarray, source: np.ndarray) -> tuple[int, int, int, int] | None:
    return sc._rows(target.shape, target.strides, source.strides, target.itemsize)


def test_numpy_copies_when_the_helper_is_not_built(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Without the helper, copies are numpy's, and the first one says so, with the fix."""
    import kvxfer.transfer.converted as package

    monkeypatch.setitem(sys.modules, "kvxfer.transfer.converted._stream_copy", None)
    monkeypatch.delattr(package, "_stream_copy", raising=False)  # an import binds it there
    monkeypatch.setattr(sc, "_library", functools.cache(sc._library.__wrapped__))
    with caplog.at_level(logging.WARNING, logger=sc.__name__):
        assert sc.native() == "numpy"
        assert sc.native() == "numpy"
    (warning,) = caplog.records  # once per process
    assert "not built" in warning.getMessage() and "reinstall" in warning.getMessage()
    source = np.arange(1 << 14, dtype=np.uint8)
    target = np.zeros_like(source)
    sc.stream_copy(target, source)
    assert np.array_equal(target, source)


def test_a_view_in_another_order_than_its_memory_is_copied_exactly() -> None:
    """BHLNC's views: the layer dim outside the head dim in the view, inside it in memory;
    the helper takes such a block as one piece, and must place it as numpy does."""
    rng = np.random.default_rng(1)
    source = rng.integers(0, 1 << 15, (8, 32, 8192), dtype=np.int16).transpose(1, 0, 2)
    target = np.zeros((8, 32, 8192), np.int16).transpose(1, 0, 2)
    assert _rows(target, source) is not None  # the helper's path, not numpy's
    sc.stream_copy(target[:, 2:6], source[:, 1:5])
    expected = np.zeros_like(target)
    expected[:, 2:6] = source[:, 1:5]
    assert np.array_equal(target, expected)


def test_arrays_that_overlap_are_copied_as_numpy_does() -> None:
    """The helper copies forward, row by row: a target overlapping its source would read
    rows it already wrote. Numpy copies through a buffer; so must this."""
    rng = np.random.default_rng(2)
    a = rng.integers(0, 256, (5, 1 << 16), dtype=np.uint8)
    expected = a.copy()
    np.copyto(expected[1:], expected[:-1].copy())
    sc.stream_copy(a[1:], a[:-1])
    assert np.array_equal(a, expected)


def test_references_are_not_copied_as_bytes() -> None:
    """An object array's elements are references: numpy counts them, bytes would not."""
    source = np.array([object() for _ in range(1 << 14)], dtype=object)
    target = np.empty_like(source)
    sc.stream_copy(target, source)
    del source
    assert all(type(x) is object for x in target)  # alive: numpy took references
