"""The address a peer announces for others to dial: its public IP and external port, which on a
rented GPU or behind a port-forwarding router differ from the address it listens on.

vast.ai gives a container a shared public IP (``PUBLIC_IPADDR``) and maps each internal TCP
port to a random external one (``VAST_TCP_PORT_<internal>``); RunPod says the same with
``RUNPOD_PUBLIC_IP`` and ``RUNPOD_TCP_PORT_<internal>`` (TCP only; the mapping changes when the
pod resets). ``--announce HOST:PORT`` says it by hand and wins over the environment.
"""

from __future__ import annotations

import argparse
import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass

from protocol.errors import ConfigError

__all__ = ["Announced", "announced", "parse_host_port", "provider_ports"]

_HOSTNAME = re.compile(
    r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)

PROVIDERS = (
    ("vast.ai", "PUBLIC_IPADDR", "VAST_TCP_PORT_"),
    ("RunPod", "RUNPOD_PUBLIC_IP", "RUNPOD_TCP_PORT_"),
)
"""(name, public IP variable, TCP port-mapping variable prefix) of each provider read."""


@dataclass(frozen=True)
class Announced:
    """An address to announce and why."""

    host: str
    port: int
    source: str
    """Where it came from: ``--announce``, or the provider's variables."""

    @property
    def maddr(self) -> str:
        """The libp2p multiaddr of the address (``/ip4``, ``/ip6`` or ``/dns``)."""
        try:
            version = ipaddress.ip_address(self.host).version
        except ValueError:
            return f"/dns/{self.host}/tcp/{self.port}"
        return f"/ip{version}/{self.host}/tcp/{self.port}"


def parse_host_port(text: str, *, what: str = "--announce") -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT`` for IPv6) → (host, port); a ConfigError naming what is wrong."""
    match = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d{1,5})|([^:\[\]]+):(\d{1,5})", text.strip())
    if match is None:
        raise ConfigError(f"{what} must be HOST:PORT (or [IPv6]:PORT), got {text!r}")
    host = match.group(1) or match.group(3)
    port = int(match.group(2) or match.group(4))
    if not 1 <= port <= 65535:
        raise ConfigError(f"{what}: port must be 1-65535, got {port}")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.match(host):
            raise ConfigError(f"{what}: {host!r} is neither an IP address nor a host name") from None
        return host, port
    if match.group(3) is not None and address.version == 6:
        raise ConfigError(f"{what}: write an IPv6 address in brackets, [{host}]:{port}")
    if address.is_unspecified or address.is_multicast:
        raise ConfigError(f"{what}: {host} cannot be dialled")
    return str(address), port


def coordinator_address(text: str) -> str:
    """argparse type of ``--coordinator``: ``HOST:PORT`` checked at once (a bare host would
    otherwise be dialled for the whole timeout), returned as given."""
    try:
        parse_host_port(text, what="the address")
    except ConfigError as exc:
        if ":" not in text:
            example = f"{text.strip() or 'localhost'}:7500"
            raise argparse.ArgumentTypeError(
                f"{text!r} has no port: give HOST:PORT, the coordinator's gRPC address (e.g. {example})"
            ) from exc
        raise argparse.ArgumentTypeError(str(exc)) from exc
    return text.strip()


def provider_ports(env: Mapping[str, str]) -> dict[str, dict[int, int]]:
    """Each provider's port mapping found in ``env``: internal port → external port (entries
    that are not ports are left out)."""
    found: dict[str, dict[int, int]] = {}
    for name, _ip_var, prefix in PROVIDERS:
        for key, value in env.items():
            internal, external = key.removeprefix(prefix), value.strip()
            if key.startswith(prefix) and internal.isdigit() and external.isdigit():
                if 1 <= int(internal) <= 65535 and 1 <= int(external) <= 65535:
                    found.setdefault(name, {})[int(internal)] = int(external)
    return found


def mapped_port(port: int, env: Mapping[str, str]) -> int | None:
    """The external port a provider's variables map ``port`` to (the bulk channel's, which
    others dial at the IP they reach this peer at), or None."""
    for mapping in provider_ports(env).values():
        if port in mapping:
            return mapping[port]
    return None


def announced(flag: str | None, *, port: int, env: Mapping[str, str]) -> Announced | None:
    """What this peer announces: ``--announce`` if given; else, when a provider's variables
    name a public IP and a mapping of the listening ``port``, that IP and the external port;
    else nothing (the addresses the daemon sees locally). Malformed variables are ignored; a
    malformed flag is a ConfigError."""
    if flag is not None:
        host, external = parse_host_port(flag)
        return Announced(host, external, "--announce")
    mappings = provider_ports(env)
    for name, ip_var, prefix in PROVIDERS:
        public = env.get(ip_var, "").strip()
        mapped = mappings.get(name, {}).get(port) if port else None
        if not public or mapped is None:
            continue
        try:
            host, _ = parse_host_port(f"{public}:{mapped}", what=ip_var)
        except ConfigError:
            continue
        return Announced(host, mapped, f"{name}: {ip_var} and {prefix}{port}")
    return None
