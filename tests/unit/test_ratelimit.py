"""``coordinator.ratelimit``: token buckets per source host."""

from __future__ import annotations

import pytest

from coordinator.ratelimit import SourceLimiter, source_host


def test_source_limiter_buckets_by_host_refill_and_forget_the_oldest() -> None:
    assert source_host("ipv4:10.0.0.7:51234") == "10.0.0.7"
    assert source_host("ipv6:[::1]:51234") == "::1"
    assert source_host("unix:/tmp/s") == "unix:/tmp/s"
    limiter = SourceLimiter(rate=2.0, burst=3.0, max_sources=2)
    assert [limiter.allow("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert limiter.allow("b", 0.0)  # another host has its own bucket
    assert limiter.allow("a", 0.5)  # refilled: 2 per second
    assert not limiter.allow("a", 0.5)
    limiter.allow("c", 0.5)  # a third host: the least recent one ("b") is forgotten
    assert set(limiter._buckets) == {"a", "c"}
    with pytest.raises(ValueError):
        SourceLimiter(rate=0.0)
