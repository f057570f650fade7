"""Checks against a run's coordinator (its ``Probe`` RPC): reachable, the same software version
and spec, clock skew, the DHT's bootstrap peers, whether the coordinator can dial this host
back, and the bandwidth between them."""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass
from typing import Any

import grpc

from peer.net.announce import Announced
from peer.net.dial_back import Greeter, ask_dial_back
from protocol import coordinator_pb2 as pb
from protocol import coordinator_pb2_grpc as pb_grpc
from protocol.messages import MessageVerifier
from protocol.version import __version__
from swarmtrain.doctor.verdict import CheckFailed, CheckWarning

PROBE_TIMEOUT_S = 10.0
PROBE_BYTES = 512 << 10
"""Per probe, the coordinator's limit (``coordinator.probe.PROBE_MAX_BYTES``)."""
TRANSFERS = 2
"""Probes each way for the bandwidth figure (a doctor run sends 2 + 2 x TRANSFERS probes)."""
SKEW_WARN_S = 5.0
SKEW_LIMIT_S = MessageVerifier.max_future_s
"""Signed messages further ahead of the coordinator's clock than this are refused."""
SLOW_UPLOAD_BITS = 10e6
FASTEST_MEASURED = 4e9
"""Above this, 512 KiB takes less time than the round trip's noise: shown as "> 4 Gbit/s"."""


@dataclass
class Link:
    """A channel to the coordinator and what its first probe said."""

    address: str
    channel: grpc.Channel
    stub: pb_grpc.CoordinatorStub
    info: pb.ProbeResponse
    skew_s: float
    rtt_s: float

    def close(self) -> None:
        self.channel.close()


def connect(address: str) -> Link:
    """Probe the coordinator at ``address``. Raises ``CheckFailed`` when it cannot be reached."""
    channel = grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 2 * PROBE_BYTES)])
    stub = pb_grpc.CoordinatorStub(channel)
    try:
        sent = time.time()
        info = stub.Probe(pb.ProbeRequest(), timeout=PROBE_TIMEOUT_S)
        received = time.time()
    except grpc.RpcError as exc:
        channel.close()
        code = exc.code()
        if code == grpc.StatusCode.UNIMPLEMENTED:
            raise CheckFailed(
                f"{address} answers gRPC but not swarmtrain's probe: an older coordinator, or not a coordinator",
                "check the address; ask the run's operator which version it runs",
            ) from exc
        raise CheckFailed(
            f"coordinator {address} unreachable ({code.name if code else 'error'}: {exc.details() or 'no details'})",
            f"check HOST:PORT, that the coordinator runs, and that this network allows outgoing TCP to port "
            f"{address.rsplit(':', 1)[-1]}",
        ) from exc
    rtt = received - sent
    skew = info.server_time - (sent + received) / 2
    return Link(address, channel, stub, info, skew, rtt)


def reachable(link: Link) -> tuple[str, dict[str, Any]]:
    info = link.info
    return (
        f"{link.address} answered in {link.rtt_s * 1000:.0f} ms (run spec {info.spec_digest[:19]}..., "
        f"{len(info.bootstrap_maddrs)} bootstrap address(es))",
        {"rtt_s": link.rtt_s, "spec_digest": info.spec_digest},
    )


def versions(link: Link) -> tuple[str, dict[str, Any]]:
    theirs = link.info.software_version
    data = {"ours": __version__, "run": theirs}
    if theirs != __version__:
        raise CheckFailed(
            f"this is swarmtrain {__version__}, the run's coordinator runs {theirs}",
            f"install the run's version: pip install 'swarmtrain=={theirs}' (or the matching docker image tag)",
            **data,
        )
    return f"swarmtrain {__version__}, as the run", data


def spec_digest(link: Link, local_digest: str, source: str) -> tuple[str, dict[str, Any]]:
    theirs = link.info.spec_digest
    data = {"local": local_digest, "run": theirs}
    if theirs != local_digest:
        raise CheckFailed(
            f"spec digest mismatch: {source} is {local_digest}, the run's is {theirs}",
            "use the run's spec: drop --spec (a peer joining with --coordinator receives it), or get the file "
            "from the run's operator",
            **data,
        )
    return f"{source} is the run's spec ({theirs})", data


def clock(link: Link) -> tuple[str, dict[str, Any]]:
    skew, rtt = link.skew_s, link.rtt_s
    data = {"skew_s": skew, "rtt_s": rtt}
    detail = f"{abs(skew):.1f} s {'ahead of' if skew < 0 else 'behind'} the coordinator (+/- {rtt / 2:.2f} s)"
    fix = "synchronise the clock: timedatectl set-ntp true (or run chrony/ntpd)"
    if abs(skew) > SKEW_LIMIT_S:
        raise CheckFailed(detail + f": signed messages beyond {SKEW_LIMIT_S:g} s are refused", fix, **data)
    if abs(skew) > SKEW_WARN_S:
        raise CheckWarning(detail, fix, **data)
    return detail, data


def bootstrap(link: Link) -> str:
    """Join the run's DHT through the coordinator's bootstrap addresses, as a client."""
    from hivemind import DHT

    maddrs = list(link.info.bootstrap_maddrs)
    if not maddrs:
        raise CheckFailed("the coordinator gave no DHT bootstrap addresses", "ask the run's operator")
    started = time.monotonic()
    try:
        dht = DHT(start=True, initial_peers=maddrs, client_mode=True)
    except Exception as exc:
        raise CheckFailed(
            f"cannot reach the run's DHT at {', '.join(maddrs)}: {exc}",
            "allow outgoing TCP to the port in those addresses (the coordinator's --dht-port)",
        ) from exc
    try:
        found = dht.get("swarmtrain-doctor-probe", latest=True)  # a round trip through the bootstrap peer
        del found
    finally:
        dht.shutdown()
    return f"joined through {len(maddrs)} bootstrap address(es) in {time.monotonic() - started:.1f} s"


def dial_back(link: Link, greeter: Greeter, announce: Announced | None = None) -> tuple[str, dict[str, Any]]:
    """Ask the coordinator to connect back to ``greeter``'s port (the announced port, with
    ``announce``) and read its greeting; say the path a peer on this machine would take
    (``peer.net.network_path``) and how to make it direct."""
    try:
        seen = ask_dial_back(link.stub, greeter, timeout_s=PROBE_TIMEOUT_S, port=announce.port if announce else 0)
    except grpc.RpcError as exc:
        raise CheckFailed(f"the coordinator refused the dial-back: {exc.details() or exc.code()}") from exc
    host, port = seen.observed_host, greeter.port
    path = "relayed" if seen.relay_port or seen.volunteer_relays else "client"
    reached = "announced" if announce else "direct"
    data = {"observed_host": host, "port": port, "error": seen.error, "path": reached if seen.reached else path}
    if announce is not None and host != announce.host:
        raise CheckWarning(
            f"{announce.maddr} is announced ({announce.source}), but the coordinator sees this machine as {host}",
            f"announce the address others reach this machine at: --announce {host}:{announce.port}",
            **data,
        )
    if seen.reached:
        forwarded = f" (forwarded to port {port})" if announce and announce.port != port else ""
        return f"{reached}: the coordinator {seen.why}{forwarded}: peers can dial it", data
    fix = (
        f"to be dialled directly, forward TCP port {port} to this machine (router port forward, firewall, cloud "
        f"security group) and start the peer with --port {port} --announce PUBLIC_IP:EXTERNAL_PORT (on vast.ai "
        "and RunPod the peer reads its port mapping from the environment)"
    )
    if seen.volunteer_relays:
        fallback = (
            f", else the coordinator's ({link.address.rsplit(':', 1)[0]}:{seen.relay_port})" if seen.relay_port else ""
        )
        how = (
            f"relayed: a peer here holds a port on one of the {seen.volunteer_relays} volunteers' relays the "
            f"coordinator lists{fallback}, and averages as a full member; its traffic crosses the relay's host twice"
        )
    elif seen.relay_port:
        how = (
            f"relayed: a peer here holds a port on the coordinator's relay ({link.address.rsplit(':', 1)[0]}:"
            f"{seen.relay_port}) and averages as a full member; its traffic crosses the relay's host twice"
        )
    else:
        how = "client: the run has no relay, so a peer here averages as a client (it never leads or reduces a part)"
    raise CheckWarning(f"the coordinator {seen.why}; {how}", fix, **data)


def bandwidth(link: Link) -> tuple[str, dict[str, Any]]:
    """Upload and download rates to the coordinator (TRANSFERS probes of PROBE_BYTES each way)."""
    payload = secrets.token_bytes(PROBE_BYTES)
    up = _rate(link, lambda: pb.ProbeRequest(payload=payload), PROBE_BYTES)
    down = _rate(link, lambda: pb.ProbeRequest(download_bytes=PROBE_BYTES), PROBE_BYTES)
    data = {"upload_bits_per_s": up, "download_bits_per_s": down}
    detail = f"upload {_mbit(up)}, download {_mbit(down)} (to the coordinator)"
    if up < SLOW_UPLOAD_BITS:
        raise CheckWarning(
            detail + ": averaging a large model will dominate each round",
            "prefer a run with stronger compression (int8, 4bit) or more inner steps per round, or a better link",
            **data,
        )
    return detail, data


def _mbit(bits_per_s: float) -> str:
    if bits_per_s >= FASTEST_MEASURED:
        return f"> {FASTEST_MEASURED / 1e9:.0f} Gbit/s"
    return f"{bits_per_s / 1e6:.0f} Mbit/s"


def _rate(link: Link, request: Any, size: int) -> float:
    best = float("inf")
    for _ in range(TRANSFERS):
        started = time.perf_counter()
        try:
            link.stub.Probe(request(), timeout=PROBE_TIMEOUT_S * 6)
        except grpc.RpcError as exc:
            raise CheckFailed(f"transfer to the coordinator failed: {exc.details() or exc.code()}") from exc
        best = min(best, time.perf_counter() - started)
    return min(8 * size / max(best - link.rtt_s, 1e-9), FASTEST_MEASURED)
