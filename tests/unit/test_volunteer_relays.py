"""Volunteers' relays: a reachable peer offers one (checked by the coordinator's dial-back,
admitting only the run's tokens), the coordinator lists the relays of peers online in its join
answers, and a peer nobody can dial asks them, in order, before the coordinator's relay. Bad
input (a relay port that is not a port, a listed relay that is not HOST:PORT, a token of
another run) is refused and changes nothing."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

from coordinator.core import Coordinator
from coordinator.http.metrics import render_metrics
from coordinator.store import Store, sqlite_url
from peer.link.coordinator_client import _relays
from peer.net.network_path import Coordinated
from peer.net.relay_client import RelayAddress, RelayError, open_several
from peer.net.relay_service import RelayOffer, offer_relay, relay_ports
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import ConfigError, MalformedMessageError
from protocol.identity import Identity
from protocol.messages import sign_message
from protocol.spec import parse_spec
from protocol.tokens import issue_token
from relay.server import Relay, describe_ports, run_token_admission
from tests.ports import free_ports
from tests.unit.relay_keys import key_of, signer

SPEC = '[run]\nname = "relays"\n'
Probe = Callable[[object, int], tuple[bool, str, int]]


@pytest.fixture
def core(tmp_path: Path) -> Iterator[Coordinator]:
    store = Store(sqlite_url(tmp_path))
    yield Coordinator(
        spec=parse_spec(SPEC), spec_toml=SPEC, identity=Identity.generate(), store=store, bootstrap_maddrs=[]
    )
    store.close()


def _join(core: Coordinator, peer: Identity, *, relay_port: int = 0, source: str = "", now: float) -> pb.JoinResponse:
    body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest, relay_port=relay_port)
    return core.join(
        sign_message(peer, kinds.JOIN, body.SerializeToString(), now=now).to_proto(), now=now, source=source
    )


def test_the_relays_of_peers_online_are_listed_to_the_others(core: Coordinator) -> None:
    now = time.time()
    a, b, c = Identity.generate(), Identity.generate(), Identity.generate()
    _join(core, a, relay_port=7701, source="203.0.113.5", now=now)
    _join(core, b, relay_port=7701, source="2001:db8::7", now=now)
    answer = _join(core, c, now=now)  # nobody can dial c: it asks them
    assert sorted(answer.relays) == ["203.0.113.5:7701", "[2001:db8::7]:7701"]
    assert list(_join(core, a, relay_port=7701, source="203.0.113.5", now=now).relays) == ["[2001:db8::7]:7701"]
    assert "swarmtrain_volunteer_relays 2.0" in render_metrics(core, now=now)
    # a relay offered from a source that is not an IP address, or on port 0, is not listed
    _join(core, Identity.generate(), relay_port=7701, source="unix:/tmp/x", now=now)
    assert sorted(_join(core, c, now=now).relays) == ["203.0.113.5:7701", "[2001:db8::7]:7701"]
    # b, silent since, is no longer listed; a, heard from again, is
    later = now + core.health.config.unreachable_s + 1
    _join(core, a, relay_port=7701, source="203.0.113.5", now=later)
    assert list(_join(core, c, now=later).relays) == ["203.0.113.5:7701"]


def test_one_party_with_many_keys_fills_no_join_answer_with_its_relays(core: Coordinator) -> None:
    """30 keys offering relays from 2 hosts (keys are free to mint) beside 3 honest volunteers
    on hosts of their own: each of 200 join answers lists at most one relay per host, so the
    party's relays are at most 2 of the 5 listed (before: 150 of 200 answers listed only
    theirs)."""
    now = time.time()
    for i in range(30):
        _join(core, Identity.generate(), relay_port=7701 + i, source=f"198.51.100.{i % 2}", now=now)
    honest = [f"203.0.113.{i}:7701" for i in range(3)]
    for relay in honest:
        _join(core, Identity.generate(), relay_port=7701, source=relay.split(":")[0], now=now)
    for _ in range(200):
        listed = list(_join(core, Identity.generate(), now=now).relays)
        theirs = [r for r in listed if r.startswith("198.51.100.")]
        assert len(theirs) <= 2 and set(honest) <= set(listed), listed
        assert len({r.rsplit(":", 1)[0] for r in listed}) == len(listed)


@pytest.mark.parametrize("port", [65536, 2**32 - 1])
def test_a_join_with_a_relay_port_that_is_no_port_is_refused_and_changes_nothing(core: Coordinator, port: int) -> None:
    with pytest.raises(MalformedMessageError, match="relay_port"):
        _join(core, Identity.generate(), relay_port=port, source="203.0.113.5", now=time.time())
    assert not core.store.peers() and not core.health.peers()


def test_listed_relays_that_are_not_host_port_are_left_out() -> None:
    listed = ["203.0.113.5:7701", "nonsense", "1.2.3.4:0", "[2001:db8::1]:9", "x" * 300 + ":1"]
    assert _relays(listed) == (("203.0.113.5", 7701), ("2001:db8::1", 9))
    assert len(_relays([f"10.0.0.{i}:7701" for i in range(50)])) == 8


@pytest.mark.parametrize(
    ("flag", "ports", "why"),
    [
        ("auto", [0] * 9, ""),  # any free ports: a control port and 8 to grant
        ("none", None, "--relay-ports none"),
        ("7801-7804", [7801, 7802, 7803, 7804], ""),
    ],
)
def test_relay_ports_from_the_flag(flag: str, ports: list[int] | None, why: str) -> None:
    got, why_not = relay_ports(flag)
    assert got == ports and why in why_not


@pytest.mark.parametrize("flag", ["7801", "7801-7801", "9-1", "0-5", "lots"])
def test_a_bad_relay_ports_flag_is_refused(flag: str) -> None:
    with pytest.raises(ConfigError, match="--relay-ports"):
        relay_ports(flag)


def test_describe_ports() -> None:
    assert describe_ports([7801, 7802, 7803]) == "7801-7803"
    assert describe_ports([7801, 7803]) == "7801, 7803"
    assert describe_ports([7801]) == "7801"
    assert describe_ports([0] * 8) == "any 8 free ports"


def test_the_relay_admits_the_runs_tokens_only() -> None:
    coordinator, peer = Identity.generate(), Identity.generate()
    revoked: set[str] = set()
    admit = run_token_admission(
        coordinator_key=coordinator.public_key, run_digest="sha256:run", revoked=lambda: revoked
    )
    now = time.time()
    token = issue_token(coordinator, run_digest="sha256:run", peer_key=peer.public_key, now=now, ttl_s=60).to_bytes()
    assert admit(token) == peer.public_key.id
    other = issue_token(coordinator, run_digest="sha256:other", peer_key=peer.public_key, now=now, ttl_s=60)
    forged = issue_token(Identity.generate(), run_digest="sha256:run", peer_key=peer.public_key, now=now, ttl_s=60)
    for bad in (other.to_bytes(), forged.to_bytes(), b"garbage"):
        with pytest.raises(ValueError, match="not a valid access token of this run"):
            admit(bad)
    revoked.add(peer.public_key.id)
    with pytest.raises(ValueError, match="revoked"):
        admit(token)


def _relay(admit_prefix: bytes, host: str = "127.0.0.1") -> Relay:
    def admit(token: bytes) -> str:
        if not token.startswith(admit_prefix):
            raise ValueError("not a valid access token of this run")
        return key_of(token)

    relay = Relay(host=host, control_port=0, ports=free_ports(1), admit=admit)
    relay.control_port = relay.start()
    return relay


def test_a_peer_asks_the_volunteers_relays_before_the_coordinators() -> None:
    coordinated = Coordinated(
        address="203.0.113.1:7500",
        stub=None,
        relay_port=7800,
        token=lambda: b"",
        sign=signer(b""),
        relays=(("198.51.100.7", 41000),),
    )
    assert [(r.host, r.port, r.whose) for r in coordinated.relay_addresses()] == [
        ("198.51.100.7", 41000, "the relay of volunteer 198.51.100.7:41000"),
        ("203.0.113.1", 7800, "the coordinator's relay"),
    ]
    alone = Coordinated(address="203.0.113.1:7500", stub=None, relay_port=0, token=lambda: b"", sign=signer(b""))
    assert alone.relay_addresses() == []  # a client, then


def test_a_peer_holds_ports_on_the_first_two_relays_that_grant_one_on_different_hosts() -> None:
    refusing, first, same_host, second = (
        _relay(b"other-", "127.0.0.2"),
        _relay(b"ok-", "127.0.0.3"),
        _relay(b"ok-", "127.0.0.3"),
        _relay(b"ok-", "127.0.0.4"),
    )
    gone = free_ports(1)[0]
    relays = [
        RelayAddress("127.0.0.5", gone, whose="volunteer A"),
        RelayAddress("127.0.0.2", refusing.control_port, whose="volunteer B"),
        RelayAddress("127.0.0.3", first.control_port, whose="volunteer C"),
        RelayAddress("127.0.0.3", same_host.control_port, whose="volunteer C's neighbour"),
        RelayAddress("127.0.0.4", second.control_port, whose="the coordinator's relay"),
    ]
    try:
        held = open_several(relays, token=lambda: b"ok-peer", sign=signer(b"ok-peer"), local_port=1)
        try:
            assert [(relay.whose, tunnel.port) for tunnel, relay in held] == [
                ("volunteer C", first.ports[0]),
                ("the coordinator's relay", second.ports[0]),  # C's neighbour shares its host: skipped
            ]
        finally:
            for tunnel, _ in held:
                tunnel.close()
        only = open_several(relays, token=lambda: b"ok-peer", sign=signer(b"ok-peer"), local_port=1, count=1)
        assert [relay.whose for _, relay in only] == ["volunteer C"]
        only[0][0].close()
        with pytest.raises(RelayError, match="refused this peer") as refused:
            open_several(relays[:2], token=lambda: b"ok-peer", sign=signer(b"ok-peer"), local_port=1)
        assert f"127.0.0.5:{gone}" in str(refused.value)  # each failure is said
    finally:
        for relay in (refusing, first, same_host, second):
            relay.stop()


def _offer(ports: Sequence[int], coordinator: Identity, probe: Probe) -> RelayOffer:
    """``offer_relay`` on loopback, the coordinator's dial-back answered by ``probe``."""
    return offer_relay(
        ports,
        "",
        stub=None,
        coordinator_key=coordinator.public_key,
        run_digest="sha256:run",
        host="127.0.0.1",
        probe=probe,
    )


def test_a_volunteer_relays_only_on_the_ports_the_coordinator_reaches() -> None:
    coordinator = Identity.generate()
    control, *grants = free_ports(4)
    reachable = {control, grants[0], grants[2]}

    def probe(stub: object, port: int) -> tuple[bool, str, int]:
        return port in reachable, f"{'reached' if port in reachable else 'cannot reach'} 127.0.0.1:{port}", port

    # a control port and nothing to grant (relay_ports refuses that flag already)
    offer = _offer(range(control, control + 1), coordinator, probe)
    assert offer.relay is None and "none of" in offer.why
    ports = [control, *grants]
    offer = _offer(ports, coordinator, probe)
    try:
        assert offer.relay is not None and offer.control_port == control
        assert offer.granted == (grants[0], grants[2]) and f"cannot reach {grants[1]}" in offer.why
        assert offer.describe().startswith(f"serving peers nobody can dial on port {control}")
        with socket.create_connection(("127.0.0.1", control), timeout=5):
            pass  # it listens
    finally:
        offer.close()
    reachable.discard(control)
    off = _offer(ports, coordinator, probe)
    assert off.relay is None and off.describe() == f"off (the coordinator cannot reach 127.0.0.1:{control})"


def test_by_default_a_volunteer_relays_on_free_ports_once_its_control_port_is_reached() -> None:
    coordinator = Identity.generate()
    asked: list[int] = []

    def probe(stub: object, port: int) -> tuple[bool, str, int]:
        asked.append(port)
        picked = free_ports(1)[0] if port == 0 else port  # as a Greeter on port 0 does
        return True, f"reached 127.0.0.1:{picked}", picked

    ports, _ = relay_ports("auto")
    offer = _offer(ports, coordinator, probe)
    try:
        assert asked == [0]  # only the control port is checked: the grants take any free port
        assert offer.relay is not None and offer.control_port != 0
        assert offer.describe() == (
            f"serving peers nobody can dial on port {offer.control_port}, granting any 8 free ports "
            "(the coordinator reached it)"
        )
        holder = Identity.generate()
        admitted = issue_token(
            coordinator, run_digest="sha256:run", peer_key=holder.public_key, now=time.time(), ttl_s=60
        ).to_bytes()
        ((tunnel, _),) = open_several(
            [RelayAddress("127.0.0.1", offer.control_port)], token=lambda: admitted, sign=holder.sign, local_port=1
        )
        try:
            assert tunnel.port not in (0, offer.control_port)  # a port the system picked at the grant
        finally:
            tunnel.close()
    finally:
        offer.close()


def test_a_volunteers_relay_refuses_a_peer_the_coordinator_revoked() -> None:
    """A banned peer's token is valid until it expires (up to 30 days): a volunteer's relay
    reads the coordinator's revocations (``MemberGate.revoked``) as the coordinator's relay does."""
    coordinator, banned, kept = Identity.generate(), Identity.generate(), Identity.generate()
    revoked: frozenset[str] = frozenset()

    def probe(stub: object, port: int) -> tuple[bool, str, int]:
        picked = free_ports(1)[0] if port == 0 else port
        return True, f"reached 127.0.0.1:{picked}", picked

    ports, _ = relay_ports("auto")
    offer = offer_relay(
        ports,
        "",
        stub=None,
        coordinator_key=coordinator.public_key,
        run_digest="sha256:run",
        host="127.0.0.1",
        probe=probe,
        revoked=lambda: revoked,
    )

    def token_of(peer: Identity) -> bytes:
        return issue_token(
            coordinator, run_digest="sha256:run", peer_key=peer.public_key, now=time.time(), ttl_s=60
        ).to_bytes()

    try:
        revoked = frozenset({banned.public_key.id})  # the list came in after the relay started
        relay = [RelayAddress("127.0.0.1", offer.control_port)]
        with pytest.raises(RelayError, match="revoked"):
            open_several(relay, token=lambda: token_of(banned), sign=banned.sign, local_port=1)
        ((tunnel, _),) = open_several(relay, token=lambda: token_of(kept), sign=kept.sign, local_port=1)
        tunnel.close()
    finally:
        offer.close()
