"""``Read.stats``: a read's time from its queueing and from its post, apart."""

from __future__ import annotations

from dataclasses import replace
from unittest.mock import Mock

import numpy as np
import pytest

from kvxfer.transfer.reads.read import Read
from kvxfer.transfer.results import ReadStats, merge_spans
from kvxfer.wire.params import RemoteParams


def remote() -> RemoteParams:
    return RemoteParams("prefill-x", "127.0.0.1", 5600, (0, 1), "lease-1", 1, 20, 1e10)


def test_the_time_from_the_post_leaves_out_the_wait_before_it() -> None:
    """NixlConnector's transfer time is NIXL's own, post to landed; kvxfer reports that
    and, apart, the time from queueing (planning, a handshake or staging space)."""
    read = Read("req", remote(), np.array([3, 4]), started=100.0)
    read.posted = 100.75
    stats = read.stats(101.0)
    assert stats.seconds == 1.0
    assert stats.posted_seconds == 0.25


def test_a_read_never_posted_has_no_time_from_its_post() -> None:
    read = Read("req", remote(), np.array([3]), started=5.0)
    assert read.stats(6.5).posted_seconds is None and read.stats(6.5).seconds == 1.5


def test_nixl_time_spans_every_path_from_the_first_post_to_the_last_completion() -> None:
    """Where NIXL moved every path, its telemetry is the read's transfer time (what
    NixlConnector reports); one path NIXL did not time (a copy) leaves it unknown."""
    read = Read("req", remote(), np.array([3]), started=5.0)
    read.posted = 5.5
    first, second = Mock(nixl_span=(5.6, 5.9)), Mock(nixl_span=(5.7, 6.1))
    for path in (first, second):
        path.add_to.side_effect = lambda stats: stats
    read.paths = [first, second]
    assert read.stats(6.5).nixl_seconds == pytest.approx(0.5)
    second.nixl_span = None
    assert read.stats(6.5).nixl_seconds is None


def test_merge_spans() -> None:
    assert merge_spans([(1.0, 2.0), (0.5, 1.5)]) == (0.5, 2.0)
    assert merge_spans([]) is None and merge_spans([(1.0, 2.0), None]) is None


def test_the_transfer_time_is_nixls_then_the_posted_time() -> None:
    """What the connector reports as ``vllm:kvxfer_xfer_time_seconds``."""
    stats = ReadStats(0, 0, 3.0, posted_seconds=2.0, nixl_seconds=1.0)
    assert stats.transfer_seconds == 1.0
    assert replace(stats, nixl_seconds=None).transfer_seconds == 2.0
    assert replace(stats, nixl_seconds=None, posted_seconds=None).transfer_seconds == 3.0
