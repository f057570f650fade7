"""Each decided round records how its time went (inner steps, matchmaking, all-reduce, landing)
and what a member sent, as the lower median of its granted reporters' figures: what the
dashboard's round split charts. One reporter cannot move a figure alone, and a report with a
figure out of bounds is refused whole."""

from __future__ import annotations

import math
import threading
import time

import pytest
from fastapi.testclient import TestClient

from coordinator.core import Coordinator
from coordinator.http.app import create_app
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import MalformedMessageError
from protocol.identity import Identity
from protocol.messages import sign_message


def _join(core: Coordinator, peers: list[Identity], now: float) -> None:
    for peer in peers:
        body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest)
        core.join(sign_message(peer, kinds.JOIN, body.SerializeToString(), now=now).to_proto(), now=now)


def _report(core: Coordinator, peer: Identity, peers: list[Identity], at: float, **figures: float) -> None:
    group = [pb.GroupMember(public_key=p.public_key.raw, weight=8.0) for p in peers]
    body = pb.RoundReportBody(round=1, samples=8, loss=3.0, state_digest="d", group=group, **figures)
    core.report_round(sign_message(peer, kinds.ROUND_REPORT, body.SerializeToString(), now=at).to_proto(), now=at)


def test_a_decided_round_records_the_lower_median_of_its_reporters_time_split(core: Coordinator) -> None:
    now = time.time()
    peers = [Identity.generate() for _ in range(3)]
    _join(core, peers, now)
    honest = {"compute_s": 5.0, "wait_s": 3.0, "allreduce_s": 2.0, "host_s": 0.5, "bytes_sent": 1000}
    _report(core, peers[0], peers, now + 30, **honest)
    _report(core, peers[1], peers, now + 30, **{**honest, "compute_s": 6.0, "host_s": 0.7, "bytes_sent": 1200})
    # a liar: 1000x everything, and a wait shorter than its all-reduce (matchmaking clamps at 0)
    _report(core, peers[2], peers, now + 30, compute_s=5000.0, wait_s=1.0, allreduce_s=2000.0, host_s=500.0,
            bytes_sent=10**9, bytes_received=10**9)  # fmt: skip
    core.tick(now=now + 50)
    (row,) = core.store.rounds()
    assert row.states == 1
    assert (row.compute_s, row.matchmaking_s, row.allreduce_s, row.landing_s) == (6.0, 1.0, 2.0, 0.7)
    assert (row.bytes_sent, row.bytes_received) == (1200.0, 0.0)

    api = TestClient(create_app(core, threading.Lock()))
    (shown,) = api.get("/api/v1/rounds").json()
    assert {k: shown[k] for k in ("states", "compute_s", "matchmaking_s", "allreduce_s", "landing_s")} == {
        "states": 1, "compute_s": 6.0, "matchmaking_s": 1.0, "allreduce_s": 2.0, "landing_s": 0.7
    }  # fmt: skip
    assert api.get("/api/v1/history").json()[-1]["rounds_failed"] == 0


def test_the_search_is_the_time_its_reporters_say_it_took(core: Coordinator) -> None:
    """Peers say how long their round's search took (``matchmaking_s``): with overlap they do
    not wait for the round, so their wait says nothing of it."""
    now = time.time()
    peers = [Identity.generate() for _ in range(3)]
    _join(core, peers, now)
    for peer, searched in zip(peers, (4.0, 6.0, 600.0)):
        _report(core, peer, peers, now + 30, compute_s=5.0, wait_s=0.0, allreduce_s=2.0, matchmaking_s=searched)
    core.tick(now=now + 50)
    (row,) = core.store.rounds()
    assert row.matchmaking_s == 6.0


@pytest.mark.parametrize("figure", ["host_s", "matchmaking_s"])
@pytest.mark.parametrize("seconds", [-1.0, math.inf, math.nan, 1e12])
def test_a_report_whose_seconds_are_out_of_bounds_is_refused_whole(
    core: Coordinator, figure: str, seconds: float
) -> None:
    now = time.time()
    peers = [Identity.generate() for _ in range(2)]
    _join(core, peers, now)
    with pytest.raises(MalformedMessageError, match=figure):
        _report(core, peers[0], peers, now + 30, compute_s=5.0, **{figure: seconds})
    assert core.store.claims() == []
