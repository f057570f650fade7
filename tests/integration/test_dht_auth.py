"""Real hivemind DHT nodes on loopback, authorized with swarmtrain tokens."""

from __future__ import annotations

import pytest
from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from protocol.hivemind_auth import SwarmTokenAuthorizer, static_token_source
from protocol.identity import Identity
from protocol.tokens import issue_token

RUN = "sha256:" + "ab" * 32
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def make_authorizer(coordinator: Identity, *, issuer: Identity | None = None) -> SwarmTokenAuthorizer:
    peer = Identity.generate()
    token = issue_token(
        issuer or coordinator, run_digest=RUN, peer_key=peer.public_key, now=get_dht_time(), ttl_s=3600
    )
    return SwarmTokenAuthorizer(
        identity=peer,
        coordinator_key=coordinator.public_key,
        run_digest=RUN,
        token_source=static_token_source(token.to_bytes()),
    )


@pytest.fixture
def dhts():  # type: ignore[no-untyped-def]
    started: list[DHT] = []

    def start(**kwargs: object) -> DHT:
        dht = DHT(start=True, host_maddrs=LOOPBACK, **kwargs)
        started.append(dht)
        return dht

    yield start
    for dht in started:
        dht.shutdown()


def test_authorized_nodes_share_records(dhts) -> None:  # type: ignore[no-untyped-def]
    coordinator = Identity.generate()
    first = dhts(authorizer=make_authorizer(coordinator))
    second = dhts(authorizer=make_authorizer(coordinator), initial_peers=first.get_visible_maddrs())
    assert second.store("k", "v", get_dht_time() + 60)
    found = first.get("k", latest=True)
    assert found is not None and found.value == "v"


class _UncheckedAuthorizer(SwarmTokenAuthorizer):
    """A malicious node: presents its forged token without checking it first."""

    async def refresh_token_if_needed(self) -> None:
        if self._local_access_token is None:
            import base64

            from hivemind.proto.auth_pb2 import AccessToken as HivemindAccessToken

            from protocol.hivemind_auth import delegation_bytes
            from protocol.tokens import decode_token

            raw = await self._token_source()
            rsa = self.local_public_key.to_bytes()
            self._local_access_token = HivemindAccessToken(
                username=base64.b64encode(raw).decode(),
                public_key=rsa,
                signature=self._identity.sign(delegation_bytes(decode_token(raw).token_id, rsa)),
            )


def test_node_with_forged_token_cannot_read_or_write(dhts) -> None:  # type: ignore[no-untyped-def]
    coordinator = Identity.generate()
    honest = dhts(authorizer=make_authorizer(coordinator))
    assert honest.store("secret", "v", get_dht_time() + 60)
    peer = Identity.generate()
    forged = issue_token(Identity.generate(), run_digest=RUN, peer_key=peer.public_key, now=get_dht_time(), ttl_s=3600)
    intruder_auth = _UncheckedAuthorizer(
        identity=peer,
        coordinator_key=coordinator.public_key,
        run_digest=RUN,
        token_source=static_token_source(forged.to_bytes()),
    )
    with pytest.raises(RuntimeError, match="none of the initial_peers responded"):
        dhts(authorizer=intruder_auth, initial_peers=honest.get_visible_maddrs())
    intruder = dhts(
        authorizer=intruder_auth, initial_peers=honest.get_visible_maddrs(), ensure_bootstrap_success=False
    )
    assert intruder.get("secret", latest=True) is None
    intruder.store("planted", "x", get_dht_time() + 60)
    assert honest.get("planted", latest=True) is None
