"""Strangers cannot lock the run's owner out of the coordinator by filling its replay guard
(``protocol.messages.ReplayGuard``): a message the coordinator refuses or does not act on (a
stranger's join to an allowlisted run, a stranger's heartbeat or admin request) takes no slot,
and one host's messages take at most its share (``max_per_source``). Each test floods a real
coordinator core (SQLite) with a guard made small enough to fill, then has the owner join."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from coordinator.core import Coordinator
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import AdmissionError, ReplayedMessageError, SwarmtrainError
from protocol.identity import Identity
from protocol.messages import ReplayGuard, sign_message
from tests.unit.conftest import new_core

GUARD, SHARE = 400, 50
STRANGERS = 2_000


def _join(core: Coordinator, who: Identity, source: str) -> pb.JoinResponse:
    body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest)
    now = time.time()
    return core.join(
        sign_message(who, kinds.JOIN, body.SerializeToString(), now=now).to_proto(), now=now, source=source
    )


def _heartbeat(core: Coordinator, who: Identity) -> None:
    now = time.time()
    core.heartbeat(
        sign_message(who, kinds.HEARTBEAT, pb.HeartbeatBody().SerializeToString(), now=now).to_proto(), now=now
    )


@pytest.fixture
def owner() -> Identity:
    return Identity.generate()


@pytest.fixture
def allowlisted(tmp_path: Path, owner: Identity) -> Iterator[Coordinator]:
    spec = f'[run]\nname = "gated"\n[admission]\nmode = "allowlist"\nallowlist = ["{owner.public_key.id}"]\n'
    core = new_core(tmp_path, spec)
    core.verifier.replay_guard = ReplayGuard(max_entries=GUARD, max_per_source=SHARE)
    yield core
    core.store.close()


def test_refused_strangers_take_no_slot_and_the_allowlisted_owner_joins(
    allowlisted: Coordinator, owner: Identity
) -> None:
    """2,000 strangers' joins from 16 hosts (5x the guard), their heartbeats and admin requests:
    all refused, none recorded; the owner then joins (before: 'too many recent messages')."""
    stranger = Identity.generate()
    for i in range(STRANGERS):
        with pytest.raises(AdmissionError, match="allowlist"):
            _join(allowlisted, Identity.generate() if i % 2 else stranger, source=f"198.51.100.{i % 16}")
        _heartbeat(allowlisted, stranger)  # answered "not admitted"
    assert len(allowlisted.verifier.replay_guard) == 0
    assert _join(allowlisted, owner, source="203.0.113.1").access_token


def test_one_host_fills_only_its_share(tmp_path: Path) -> None:
    """An open run admits anyone, so strangers' joins are recorded: 3 hosts sending 10x their
    share each are refused past it, and a peer from another host still joins."""
    core = new_core(tmp_path)
    core.verifier.replay_guard = ReplayGuard(max_entries=GUARD, max_per_source=SHARE)
    try:
        for host in ("198.51.100.1", "198.51.100.2", "198.51.100.3"):
            admitted = refused = 0
            for _ in range(10 * SHARE):
                try:
                    _join(core, Identity.generate(), source=host)
                    admitted += 1
                except ReplayedMessageError as exc:
                    assert host in str(exc)
                    refused += 1
            assert (admitted, refused) == (SHARE, 9 * SHARE)
        assert _join(core, Identity.generate(), source="203.0.113.1").access_token
    finally:
        core.store.close()


def test_a_replayed_join_is_still_refused(allowlisted: Coordinator, owner: Identity) -> None:
    """Recording after admission keeps the replay check: the same signed join twice fails."""
    body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=allowlisted.digest)
    now = time.time()
    envelope = sign_message(owner, kinds.JOIN, body.SerializeToString(), now=now).to_proto()
    allowlisted.join(envelope, now=now, source="203.0.113.1")
    with pytest.raises(SwarmtrainError, match="already received"):
        allowlisted.join(envelope, now=now, source="203.0.113.1")
