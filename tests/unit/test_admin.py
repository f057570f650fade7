"""Operator requests to the coordinator core: who may send them, what they change, bad input."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from coordinator.core import Coordinator
from coordinator.store import Store, sqlite_url
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import AdmissionError, MalformedMessageError, VerificationError
from protocol.identity import Identity
from protocol.messages import sign_message
from protocol.spec import parse_spec

SPEC = '[run]\nname = "ops"\n[admission]\nmode = "allowlist"\nallowlist = ["{listed}"]\n'


@pytest.fixture
def setup(tmp_path: Path):  # type: ignore[no-untyped-def]
    listed, owner, helper = Identity.generate(), Identity.generate(), Identity.generate()
    text = SPEC.format(listed=listed.public_key.id)
    store = Store(sqlite_url(tmp_path))
    core = Coordinator(
        spec=parse_spec(text),
        spec_toml=text,
        identity=owner,
        store=store,
        bootstrap_maddrs=[],
        operators=(helper.public_key.id,),
    )
    yield core, store, listed, owner, helper, text
    store.close()


def request(
    signer: Identity, action: int, key: str = "", reason: str = "", kind: str = kinds.ADMIN
) -> pb.SignedEnvelope:
    body = pb.AdminBody(action=action, key=key, reason=reason).SerializeToString()
    return sign_message(signer, kind, body, now=time.time()).to_proto()


def join(core: Coordinator, peer: Identity) -> None:
    body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest)
    core.join(sign_message(peer, kinds.JOIN, body.SerializeToString(), now=time.time()).to_proto(), now=time.time())


def heartbeat(core: Coordinator, peer: Identity) -> bool:
    envelope = sign_message(peer, kinds.HEARTBEAT, pb.HeartbeatBody().SerializeToString(), now=time.time()).to_proto()
    return core.heartbeat(envelope, now=time.time()).admitted


def test_operators_edit_the_allowlist_and_ban_with_immediate_effect(setup) -> None:  # type: ignore[no-untyped-def]
    core, store, listed, owner, helper, _ = setup
    newcomer = Identity.generate()
    with pytest.raises(AdmissionError, match="allowlist"):
        join(core, newcomer)
    response = core.admin(request(helper, pb.ADMIN_ACTION_ALLOW, newcomer.public_key.id), now=time.time())
    assert set(response.allowlist) == {listed.public_key.id, newcomer.public_key.id}
    join(core, newcomer)
    join(core, listed)
    assert heartbeat(core, newcomer) and heartbeat(core, listed)

    response = core.admin(request(owner, pb.ADMIN_ACTION_DISALLOW, newcomer.public_key.id), now=time.time())
    assert "1 peer(s) dropped" in response.message and not heartbeat(core, newcomer)
    with pytest.raises(AdmissionError, match="allowlist"):
        join(core, newcomer)

    response = core.admin(request(owner, pb.ADMIN_ACTION_BAN, listed.public_key.id, "spam"), now=time.time())
    assert [(b.key, b.reason) for b in response.bans] == [(listed.public_key.id, "spam")]
    assert not heartbeat(core, listed)
    with pytest.raises(AdmissionError, match="banned"):
        join(core, listed)
    core.admin(request(owner, pb.ADMIN_ACTION_UNBAN, listed.public_key.id), now=time.time())
    join(core, listed)
    assert heartbeat(core, listed)


def test_non_operators_and_bad_requests_change_nothing(setup) -> None:  # type: ignore[no-untyped-def]
    core, store, listed, _, helper, _ = setup
    before = (store.allowlist(), store.bans())
    stranger = Identity.generate()
    with pytest.raises(AdmissionError, match="not an operator"):
        core.admin(request(stranger, pb.ADMIN_ACTION_ALLOW, stranger.public_key.id), now=time.time())
    with pytest.raises(MalformedMessageError, match="not a public id"):
        core.admin(request(helper, pb.ADMIN_ACTION_BAN, "ed25519:nope"), now=time.time())
    with pytest.raises(MalformedMessageError, match="unknown action"):
        core.admin(request(helper, 99, listed.public_key.id), now=time.time())
    with pytest.raises(VerificationError):  # a heartbeat signature is not an admin request
        core.admin(request(helper, pb.ADMIN_ACTION_BAN, listed.public_key.id, kind=kinds.HEARTBEAT), now=time.time())
    replayed = request(helper, pb.ADMIN_ACTION_LIST)
    core.admin(replayed, now=time.time())
    with pytest.raises(VerificationError):
        core.admin(replayed, now=time.time())
    assert (store.allowlist(), store.bans()) == before


def test_live_removals_survive_a_restart(setup) -> None:  # type: ignore[no-untyped-def]
    core, store, listed, owner, _, text = setup
    core.admin(request(owner, pb.ADMIN_ACTION_DISALLOW, listed.public_key.id), now=time.time())
    again = Coordinator(spec=parse_spec(text), spec_toml=text, identity=owner, store=store, bootstrap_maddrs=[])
    assert listed.public_key.id not in store.allowlist()  # the spec's list seeds the first start only
    assert again.operators == {owner.public_key.id}
