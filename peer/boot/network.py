"""How a started peer is reached and linked: its network path, the relay it offers, its hole
puncher and relay keeper, and its link to the coordinator (heartbeats, reports, re-joins)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import threading
import time
from collections.abc import Sequence

from peer.boot.join import Joined
from peer.link.coordinator_client import JoinAs, join_when_up
from peer.link.coordinator_link import CoordinatorLink
from peer.link.report_outbox import OUTBOX_DIR, ReportOutbox
from peer.net.announce import parse_host_port
from peer.net.network_path import Coordinated, NetworkPath, choose_path
from peer.net.puncher import Puncher, relays_by_ip
from peer.net.relay_client import RelayAddress, RelayTunnel, open_several
from peer.net.relay_keeper import PUBLISH_S, Found, RelayKeeper
from peer.net.relay_service import RelayOffer, offer_relay, relay_ports
from peer.swarm.swarm import Swarm
from protocol.membership import MemberGate
from protocol.statesync import run_prefix


def network_path(args: argparse.Namespace, joined: Joined) -> NetworkPath:
    """How others reach this peer (``peer.net.network_path``); ``args.port`` and ``args.client_mode``
    follow the choice."""
    coordinated = None
    if joined.client is not None and joined.info is not None:
        info = joined.info
        coordinated = Coordinated(
            address=args.coordinator,
            stub=joined.client.stub,
            relay_port=info.relay_port,
            token=lambda: info.access_token,
            sign=joined.client.identity.sign,
            relays=info.relays,
        )
    host = args.host if args.host not in ("0.0.0.0", "") else "127.0.0.1"
    path = choose_path(
        client_mode=args.client_mode,
        announce=args.announce,
        port=args.port,
        env=os.environ,
        coordinated=coordinated,
        local_host=host,
        hole_punch=args.hole_punch,
    )
    args.port, args.client_mode = path.port, path.client_mode
    return path


def member_gate(joined: Joined) -> MemberGate | None:
    """Which peers the run's coordinator admitted, from its tokens and revocations in the DHT
    (``protocol.membership``; refreshed by the swarm); None without a coordinator."""
    if joined.info is None:
        return None

    return MemberGate(
        coordinator_key=joined.info.coordinator_key,
        run_digest=joined.info.spec_digest,
        prefix=run_prefix(joined.info.spec_digest),
    )


def relay_offer(
    args: argparse.Namespace, joined: Joined, path: NetworkPath, gate: MemberGate | None
) -> RelayOffer | None:
    """The relay this peer runs for peers nobody can dial (``peer.net.relay_service``): only a peer
    the coordinator dialled back; None without a coordinator. It refuses the peers ``gate``
    shows revoked."""
    if joined.client is None or joined.info is None:
        return None

    if not path.dialled_back:
        return RelayOffer(None, f"this peer is {path.kind}, not dialled back directly")
    ports, why_not = relay_ports(args.relay_ports)
    return offer_relay(
        ports,
        why_not,
        stub=joined.client.stub,
        coordinator_key=joined.info.coordinator_key,
        run_digest=joined.info.spec_digest,
        host=args.host or "0.0.0.0",
        revoked=(lambda: gate.revoked) if gate is not None else frozenset,
    )


def _renewed(token: bytes, swarm: Swarm, path: NetworkPath | None, puncher: Puncher | None = None) -> None:
    """A renewed access token goes to the swarm's membership record, to the relays it holds
    ports on, and to the puncher (relays admit punches by token)."""
    swarm.publish_membership(token)
    if path is not None:
        path.use_token(token)
    if puncher is not None:
        puncher.use_token(token)


def start_puncher(args: argparse.Namespace, joined: Joined, swarm: Swarm, path: NetworkPath) -> Puncher | None:
    """Hole punching to the relayed peers this one dials (``peer.net.puncher``), with
    ``--hole-punch`` (the default): through a coordinator, which lists the relays; not in client mode."""
    if joined.info is None or joined.client is None or args.client_mode or not args.hole_punch:
        return None

    listed = list(joined.info.relays)
    if joined.info.relay_port:
        listed.append((parse_host_port(args.coordinator, what="--coordinator")[0], joined.info.relay_port))
    relays = relays_by_ip(listed)
    info = joined.info
    puncher = Puncher(
        swarm.dht,
        relays=relays,
        token=lambda: info.access_token,
        sign=joined.client.identity.sign,
        quiet=lambda: not swarm.averaging(),
        direct=path.direct,
    )
    puncher.start()
    return puncher


def start_relay_keeper(
    args: argparse.Namespace,
    joined: Joined,
    swarm: Swarm,
    path: NetworkPath,
    link: CoordinatorLink | None,
    puncher: Puncher | None,
) -> RelayKeeper | None:
    """A relayed peer's watch over its relays (``peer.net.relay_keeper``): when all have left, new
    ones from the coordinator's list, and the swarm moved to them."""
    if path.kind != "relayed" or joined.client is None or link is None:
        return None

    client = joined.client
    host = args.host if args.host not in ("0.0.0.0", "") else "127.0.0.1"
    latest: list[bytes] = []

    def find() -> Found:
        info = client.join_as(link.rejoin)
        latest[:] = [info.access_token]
        listed = Coordinated(
            address=args.coordinator,
            stub=client.stub,
            relay_port=info.relay_port,
            token=lambda: info.access_token,
            sign=client.identity.sign,
            relays=info.relays,
        )
        return Found(tuple(listed.relay_addresses()), info.access_token)

    def open_relays(relays: Sequence[RelayAddress], token: bytes) -> list[tuple[RelayTunnel, RelayAddress]]:
        return open_several(
            relays,
            token=lambda: token,
            sign=client.identity.sign,
            local_port=path.port,
            local_host=host,
            direct=path.direct,
            answer_punches=args.hole_punch,
        )

    def moved() -> None:
        link.rejoin = dataclasses.replace(link.rejoin, maddrs=tuple(swarm.visible_maddrs))
        if puncher is not None:
            puncher.moved(swarm.dht)
        if latest:
            path.use_token(latest[0])
            if puncher is not None:
                puncher.use_token(latest[0])
            end = time.monotonic() + PUBLISH_S  # the new node stores nothing before it meets others
            while not swarm.publish_membership(latest[0], timeout_s=5.0) and time.monotonic() < end:
                time.sleep(1.0)

    keeper = RelayKeeper(
        path,
        find=find,
        open_relays=open_relays,
        move=swarm.move_to,
        moved=moved,
        say=lambda line: print(line, flush=True),
    )
    keeper.start()
    return keeper


def say_punched(path: NetworkPath) -> None:
    """The punches other peers asked this one for at its relays, at exit."""
    answered = sum(tunnel.punched for tunnel in path.tunnels)
    if path.tunnels:
        carried = sum(tunnel.bytes_punched for tunnel in path.tunnels)
        print(f"hole punch: answered {answered} (carried {carried:,} bytes directly)", flush=True)


def link_to_coordinator(
    args: argparse.Namespace,
    joined: Joined,
    swarm: Swarm,
    stop: threading.Event,
    path: NetworkPath | None = None,
    relay: RelayOffer | None = None,
    puncher: Puncher | None = None,
) -> CoordinatorLink | None:
    """Through a coordinator: join again with this peer's swarm addresses (the token now names
    its libp2p id), publish the membership token, and start the heartbeats and reports."""
    if joined.client is None or joined.info is None:
        return None

    rejoin = JoinAs(
        libp2p_peer_id=str(swarm.dht.peer_id),
        maddrs=tuple(swarm.visible_maddrs),
        reachable=not args.client_mode,
        spec_digest=joined.info.spec_digest,
        network_path=path.kind if path is not None else "",
        relay_port=relay.control_port if relay is not None else 0,
    )
    admitted = join_when_up(joined.client, rejoin, say=lambda line: print(line, flush=True))
    _renewed(admitted.access_token, swarm, path, puncher)
    link = CoordinatorLink(
        joined.client,
        interval_s=joined.info.heartbeat_interval_s,
        rejoin=rejoin,
        on_refused=lambda reason: stop.set(),
        token=admitted.access_token,
        on_token=lambda token: _renewed(token, swarm, path, puncher),
        data_slot=joined.slot if joined.spec.data.source == "tokens" else None,
        outbox=ReportOutbox(args.checkpoint_dir / OUTBOX_DIR if args.checkpoint_dir is not None else None),
    )
    if path is not None:
        link.punched_peers = lambda: len(path.direct)
    link.start()
    print(f"joined through coordinator {args.coordinator}", flush=True)
    return link
