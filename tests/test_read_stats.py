"""``Read.stats``: a read's time from its queueing and from its post, apart."""

from __future__ import annotations

import numpy as np

from kvxfer.transfer.reads.read import Read
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
