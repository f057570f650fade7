"""The hivemind authorizer adapter, exercised on real hivemind request/response protobufs."""

from __future__ import annotations

import asyncio

import pytest
from hivemind.proto import dht_pb2
from hivemind.utils.crypto import RSAPrivateKey

from protocol.errors import WrongSignerError
from protocol.hivemind_auth import SwarmTokenAuthorizer, static_token_source
from protocol.identity import Identity, PublicKey
from protocol.tokens import issue_token

NOW = 1_800_000_000.0
RUN = "sha256:" + "ab" * 32


class Clock:
    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


class Swarm:
    """A coordinator key plus helpers to make peers' authorizers."""

    def __init__(self) -> None:
        self.coordinator = Identity.generate()
        self.clock = Clock()
        self.banned: set[PublicKey] = set()

    def authorizer(
        self, *, issuer: Identity | None = None, run: str = RUN, ttl_s: float = 3600.0, peer: Identity | None = None
    ) -> SwarmTokenAuthorizer:
        peer = peer or Identity.generate()
        token = issue_token(
            issuer or self.coordinator, run_digest=run, peer_key=peer.public_key, now=self.clock.now, ttl_s=ttl_s
        )
        auth = SwarmTokenAuthorizer(
            identity=peer,
            coordinator_key=self.coordinator.public_key,
            run_digest=RUN,
            token_source=static_token_source(token.to_bytes()),
            clock=self.clock,
            is_revoked=lambda key: key in self.banned,
            local_private_key=RSAPrivateKey(),
        )
        auth._peer = peer  # type: ignore[attr-defined]
        return auth


async def signed_ping(auth: SwarmTokenAuthorizer) -> dht_pb2.PingRequest:
    request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"n"))
    await auth.sign_request(request, None)
    return request


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


@pytest.fixture
def swarm() -> Swarm:
    return Swarm()


def test_authorized_peers_exchange_requests_and_responses(swarm: Swarm) -> None:
    client, server = swarm.authorizer(), swarm.authorizer()

    async def scenario() -> None:
        request = await signed_ping(client)
        assert await server.validate_request(request)
        response = dht_pb2.PingResponse(dht_time=1.0)
        await server.sign_response(response, request)
        assert await client.validate_response(response, request)

    run(scenario())


def test_replayed_request_is_refused(swarm: Swarm) -> None:
    client, server = swarm.authorizer(), swarm.authorizer()

    async def scenario() -> None:
        request = await signed_ping(client)
        copy = dht_pb2.PingRequest()
        copy.CopyFrom(request)
        assert await server.validate_request(request)
        assert not await server.validate_request(copy)

    run(scenario())


def _forge(auth: SwarmTokenAuthorizer, token_bytes: bytes) -> None:
    auth._token_source = static_token_source(token_bytes)


def test_forged_token_is_refused_by_holder_and_by_others(swarm: Swarm) -> None:
    server = swarm.authorizer()
    mallory = Identity.generate()
    forged = issue_token(Identity.generate(), run_digest=RUN, peer_key=mallory.public_key, now=NOW, ttl_s=3600)
    client = swarm.authorizer(peer=mallory)
    _forge(client, forged.to_bytes())
    with pytest.raises(WrongSignerError):
        run(signed_ping(client))  # an honest client refuses to present it
    # a modified client that skips its own check builds the hivemind token by hand
    hm_token = _hivemind_token_unchecked(client, forged.to_bytes(), mallory)
    assert not server.is_token_valid(hm_token)
    with pytest.raises(WrongSignerError, match="not by this run's coordinator"):
        server.check(hm_token)


def _hivemind_token_unchecked(auth: SwarmTokenAuthorizer, token_bytes: bytes, peer: Identity):  # type: ignore[no-untyped-def]
    import base64

    from hivemind.proto.auth_pb2 import AccessToken as HivemindAccessToken

    from protocol.hivemind_auth import delegation_bytes
    from protocol.tokens import decode_token

    token = decode_token(token_bytes)
    rsa = auth.local_public_key.to_bytes()
    return HivemindAccessToken(
        username=base64.b64encode(token_bytes).decode(),
        public_key=rsa,
        expiration_time="",
        signature=peer.sign(delegation_bytes(token.token_id, rsa)),
    )


def test_wrong_run_token_is_refused(swarm: Swarm) -> None:
    server = swarm.authorizer()
    mallory = Identity.generate()
    other_run = issue_token(
        swarm.coordinator, run_digest="sha256:" + "00" * 32, peer_key=mallory.public_key, now=NOW, ttl_s=3600
    )
    client = swarm.authorizer(peer=mallory)
    with pytest.raises(Exception, match="is for run"):
        server.check(_hivemind_token_unchecked(client, other_run.to_bytes(), mallory))


def test_expired_token_is_refused_and_refreshed_before_expiry(swarm: Swarm) -> None:
    client, server = swarm.authorizer(ttl_s=600), swarm.authorizer(ttl_s=6000)

    async def scenario() -> None:
        request = await signed_ping(client)
        token = request.auth.client_access_token
        assert not client.does_token_need_refreshing(token)
        swarm.clock.now = NOW + 550
        assert client.does_token_need_refreshing(token)
        swarm.clock.now = NOW + 601
        assert not server.is_token_valid(token)

    run(scenario())


def test_stolen_token_is_useless_without_the_peer_key(swarm: Swarm) -> None:
    victim, server = swarm.authorizer(), swarm.authorizer()
    thief_rsa = RSAPrivateKey()

    async def scenario() -> None:
        stolen = (await signed_ping(victim)).auth.client_access_token
        # 1. the thief presents the token as is, but must sign with its own RSA key
        request = dht_pb2.PingRequest(peer=dht_pb2.NodeInfo(node_id=b"n"))
        request.auth.client_access_token.CopyFrom(stolen)
        request.auth.time = NOW
        request.auth.nonce = b"12345678"
        request.auth.signature = thief_rsa.sign(request.SerializeToString())
        assert not await server.validate_request(request)
        # 2. the thief swaps in its own RSA key: the peer's delegation no longer matches
        swapped = type(stolen)()
        swapped.CopyFrom(stolen)
        swapped.public_key = thief_rsa.get_public_key().to_bytes()
        with pytest.raises(Exception, match="not vouched for"):
            server.check(swapped)

    run(scenario())


def test_banned_peer_is_refused_at_once(swarm: Swarm) -> None:
    client, server = swarm.authorizer(), swarm.authorizer()

    async def scenario() -> None:
        assert await server.validate_request(await signed_ping(client))
        swarm.banned.add(client._peer.public_key)  # type: ignore[attr-defined]
        assert not await server.validate_request(await signed_ping(client))

    run(scenario())


def test_garbage_in_hivemind_token_is_refused(swarm: Swarm) -> None:
    from hivemind.proto.auth_pb2 import AccessToken as HivemindAccessToken

    server = swarm.authorizer()
    for username in ["", "not base64!", "aGVsbG8="]:
        assert not server.is_token_valid(HivemindAccessToken(username=username, public_key=b"k", signature=b"s"))
