"""HealthTracker: every transition with explicit ``now`` values, heartbeat validation, summary."""

from __future__ import annotations

import math

import pytest

from coordinator.health import HealthConfig, HealthTracker, PeerState, UnknownPeerError

# interval 5 s: unreachable after > 15 s of silence, offline after > 60 s
CONFIG = HealthConfig(heartbeat_interval_s=5.0, unreachable_after=3.0, offline_after=12.0, straggle_rounds=2)


def _tracker(*keys: str, now: float = 0.0) -> HealthTracker:
    tracker = HealthTracker(CONFIG)
    for key in keys:
        tracker.join(key, libp2p_peer_id=f"Qm{key}", software_version="0.1", reachable=True, now=now)
    return tracker


def _beat(
    tracker: HealthTracker,
    key: str,
    now: float,
    *,
    round: int = 0,
    phase: str = "training",
    sps: float = 10.0,
    total: int = 100,
    loss: float | None = 2.5,
):
    return tracker.heartbeat(
        key, now=now, round=round, phase=phase, samples_per_second=sps, samples_total=total, loss=loss
    )


def test_join_starts_in_joining() -> None:
    tracker = _tracker("a", now=7.0)
    peer = tracker.get("a")
    assert peer is not None
    assert (peer.state, peer.joined_at, peer.last_seen, peer.round) == (PeerState.JOINING, 7.0, 7.0, 0)
    assert tracker.get("nobody") is None


@pytest.mark.parametrize(
    ("phase", "state"),
    [
        ("joining", PeerState.JOINING),
        ("training", PeerState.TRAINING),
        ("averaging", PeerState.AVERAGING),
        ("leaving", PeerState.OFFLINE),
    ],
)
def test_heartbeat_phase_sets_state(phase: str, state: PeerState) -> None:
    tracker = _tracker("a")
    peer = _beat(tracker, "a", 1.0, phase=phase, round=3, sps=12.5, total=40, loss=1.5)
    assert peer.state == state
    assert (peer.round, peer.samples_per_second, peer.samples_total, peer.loss, peer.last_seen) == (
        3,
        12.5,
        40,
        1.5,
        1.0,
    )


def test_training_to_averaging_and_back() -> None:
    tracker = _tracker("a")
    assert _beat(tracker, "a", 1.0, phase="training").state == PeerState.TRAINING
    assert _beat(tracker, "a", 2.0, phase="averaging").state == PeerState.AVERAGING
    assert _beat(tracker, "a", 3.0, phase="training", round=1).state == PeerState.TRAINING


def test_silence_makes_unreachable_then_offline() -> None:
    tracker = _tracker("a")
    _beat(tracker, "a", 10.0)
    assert tracker.tick(25.0) == []  # exactly 15 s: not yet
    assert tracker.tick(25.1) == [("a", PeerState.TRAINING, PeerState.UNREACHABLE)]
    assert tracker.tick(30.0) == []  # reported once
    assert tracker.tick(70.0) == []  # exactly 60 s: not yet offline
    assert tracker.tick(70.1) == [("a", PeerState.UNREACHABLE, PeerState.OFFLINE)]
    assert tracker.tick(500.0) == []


def test_long_silence_goes_straight_to_offline() -> None:
    tracker = _tracker("a", now=0.0)
    assert tracker.tick(100.0) == [("a", PeerState.JOINING, PeerState.OFFLINE)]


def test_heartbeat_revives_unreachable_and_offline_peers() -> None:
    tracker = _tracker("a")
    tracker.tick(20.0)
    assert tracker.get("a").state == PeerState.UNREACHABLE  # type: ignore[union-attr]
    assert _beat(tracker, "a", 21.0, phase="averaging").state == PeerState.AVERAGING
    tracker.tick(100.0)
    assert tracker.get("a").state == PeerState.OFFLINE  # type: ignore[union-attr]
    assert _beat(tracker, "a", 101.0, phase="training").state == PeerState.TRAINING
    assert tracker.tick(102.0) == []


def test_leaving_is_offline_at_once_and_stays() -> None:
    tracker = _tracker("a")
    _beat(tracker, "a", 1.0, phase="training")
    assert _beat(tracker, "a", 2.0, phase="leaving").state == PeerState.OFFLINE
    assert tracker.tick(1000.0) == []


def test_rejoin_starts_over_in_joining() -> None:
    tracker = _tracker("a")
    _beat(tracker, "a", 5.0, round=4, phase="averaging")
    peer = tracker.join("a", libp2p_peer_id="QmNew", software_version="0.2", reachable=False, now=9.0)
    assert (peer.state, peer.round, peer.libp2p_peer_id, peer.reachable, peer.joined_at) == (
        PeerState.JOINING,
        0,
        "QmNew",
        False,
        9.0,
    )


def test_straggler_detected_by_tick_and_recovers() -> None:
    tracker = _tracker("a", "b")
    _beat(tracker, "a", 1.0, round=2)
    _beat(tracker, "b", 1.0, round=2, phase="averaging")
    _beat(tracker, "a", 2.0, round=4)  # b is 2 behind: allowed
    assert tracker.tick(3.0) == []
    _beat(tracker, "a", 4.0, round=5)  # b is 3 behind
    assert tracker.tick(5.0) == [("b", PeerState.AVERAGING, PeerState.STRAGGLING)]
    # still behind: a heartbeat keeps it straggling
    assert _beat(tracker, "b", 6.0, round=2, phase="training").state == PeerState.STRAGGLING
    assert tracker.tick(7.0) == []
    # caught up: back to the phase it reports
    assert _beat(tracker, "b", 8.0, round=3, phase="averaging").state == PeerState.AVERAGING


def test_straggler_returns_to_phase_on_tick_when_leader_goes_offline() -> None:
    tracker = _tracker("a", "b")
    _beat(tracker, "a", 0.0, round=10)
    _beat(tracker, "b", 0.0, round=1)
    assert tracker.get("b").state == PeerState.STRAGGLING  # type: ignore[union-attr]
    _beat(tracker, "b", 50.0, round=1)
    # a is silent > 60 s: offline, so the swarm round is b's own; b is no longer behind
    assert tracker.tick(61.0) == [
        ("a", PeerState.TRAINING, PeerState.OFFLINE),
        ("b", PeerState.STRAGGLING, PeerState.TRAINING),
    ]


def test_joining_peer_never_straggles() -> None:
    tracker = _tracker("a", "b")
    _beat(tracker, "a", 1.0, round=50)
    _beat(tracker, "b", 1.0, round=0, phase="joining")
    assert tracker.tick(2.0) == []
    assert tracker.get("b").state == PeerState.JOINING  # type: ignore[union-attr]


def test_unreachable_peer_still_counts_for_swarm_round_but_offline_does_not() -> None:
    tracker = _tracker("a", "b")
    _beat(tracker, "a", 0.0, round=10)
    _beat(tracker, "b", 0.0, round=9)
    _beat(tracker, "b", 20.0, round=9)
    tracker.tick(20.0)
    assert tracker.get("a").state == PeerState.UNREACHABLE  # type: ignore[union-attr]
    assert tracker.summary(20.0).swarm_round == 10
    _beat(tracker, "b", 61.0, round=9)
    tracker.tick(61.0)
    assert tracker.summary(61.0).swarm_round == 9


def test_stale_heartbeat_does_not_move_last_seen_backwards() -> None:
    tracker = _tracker("a")
    _beat(tracker, "a", 10.0)
    peer = _beat(tracker, "a", 4.0, round=1)
    assert peer.last_seen == 10.0
    assert peer.round == 1
    assert tracker.tick(25.0) == []  # silence measured from 10.0, not 4.0


def test_unknown_peer_heartbeat_raises() -> None:
    tracker = _tracker("a")
    with pytest.raises(UnknownPeerError, match="unknown peer 'b'"):
        _beat(tracker, "b", 1.0)
    assert issubclass(UnknownPeerError, ValueError)


def test_remove_forgets_peer() -> None:
    tracker = _tracker("a", "b")
    tracker.remove("a")
    tracker.remove("never-there")
    assert [p.key for p in tracker.peers()] == ["b"]
    with pytest.raises(UnknownPeerError):
        _beat(tracker, "a", 1.0)


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [
        ("round", {"round": -1}),
        ("round", {"round": 1.5}),
        ("phase", {"phase": "dancing"}),
        ("samples_per_second", {"sps": -1.0}),
        ("samples_per_second", {"sps": math.nan}),
        ("samples_per_second", {"sps": math.inf}),
        ("samples_total", {"total": -5}),
        ("samples_total", {"total": 3.5}),
        ("loss", {"loss": math.nan}),
    ],
)
def test_bad_heartbeat_values_rejected_and_change_nothing(field: str, kwargs: dict) -> None:
    tracker = _tracker("a")
    _beat(tracker, "a", 1.0, round=2, sps=5.0, total=10)
    with pytest.raises(ValueError, match=field):
        _beat(tracker, "a", 2.0, **kwargs)
    peer = tracker.get("a")
    assert peer is not None
    assert (peer.round, peer.samples_per_second, peer.samples_total, peer.last_seen) == (2, 5.0, 10, 1.0)


def test_bad_heartbeat_for_unknown_peer_reports_the_value_first() -> None:
    with pytest.raises(ValueError, match="phase"):
        _beat(_tracker(), "x", 1.0, phase="bogus")


def test_summary_counts_online_peers_and_sums_throughput() -> None:
    tracker = _tracker("a", "b", "c", "d")
    _beat(tracker, "a", 0.0, round=3, sps=10.0)
    _beat(tracker, "b", 0.0, round=4, sps=20.0, phase="averaging")
    _beat(tracker, "c", 0.0, round=9, sps=100.0, phase="leaving")  # offline: ignored everywhere
    _beat(tracker, "d", 0.0, round=2, sps=7.0, phase="joining")
    summary = tracker.summary(1.0)
    assert (summary.peers_online, summary.samples_per_second, summary.swarm_round) == (3, 37.0, 4)
    # b keeps beating; a and d go silent past 15 s: not online even before tick records it
    _beat(tracker, "b", 14.0, round=4, sps=20.0)
    summary = tracker.summary(16.0)
    assert (summary.peers_online, summary.samples_per_second, summary.swarm_round) == (1, 20.0, 4)
    tracker.tick(16.0)
    assert {p.key: p.state for p in tracker.peers()} == {
        "a": PeerState.UNREACHABLE,
        "b": PeerState.TRAINING,
        "c": PeerState.OFFLINE,
        "d": PeerState.UNREACHABLE,
    }


def test_summary_of_empty_swarm() -> None:
    summary = _tracker().summary(0.0)
    assert (summary.peers_online, summary.samples_per_second, summary.swarm_round) == (0, 0.0, 0)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="heartbeat_interval_s"):
        HealthConfig(heartbeat_interval_s=0.0)
    with pytest.raises(ValueError, match="offline_after"):
        HealthConfig(unreachable_after=5.0, offline_after=2.0)


def test_repeated_offences_flag_a_peer_until_enough_clean_claims_push_them_out() -> None:
    from coordinator.health import FLAG_OFFENCES, RECENT_CLAIMS

    tracker = _tracker("a", "b")
    for _ in range(FLAG_OFFENCES - 1):
        tracker.record_claim("a", offence=True)
    tracker.record_claim("b", offence=False)
    assert tracker.flagged() == 0
    tracker.record_claim("a", offence=True)
    peers = {p.key: p for p in tracker.peers()}
    assert peers["a"].flagged and peers["a"].offences == FLAG_OFFENCES and not peers["b"].flagged
    assert tracker.flagged() == 1
    for _ in range(RECENT_CLAIMS):  # only recent claims count
        tracker.record_claim("a", offence=False)
    assert tracker.flagged() == 0
    tracker.record_claim("nobody", offence=True)  # a key not tracked (removed, never joined): ignored
    assert tracker.flagged() == 0
