"""The address a peer announces (``peer.net.announce``): ``--announce``, else a provider's port
mapping of the listening port, else none; malformed input is one clear error or ignored."""

from __future__ import annotations

import pytest

from peer.net.announce import Announced, announced, parse_host_port, provider_ports
from protocol.errors import ConfigError

VAST = {"PUBLIC_IPADDR": "203.0.113.7", "VAST_TCP_PORT_4000": "41234", "VAST_TCP_PORT_22": "41000"}
RUNPOD = {"RUNPOD_PUBLIC_IP": "198.51.100.9", "RUNPOD_TCP_PORT_4000": "18123"}


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("203.0.113.7:41234", ("203.0.113.7", 41234)),
        ("[2001:db8::1]:4000", ("2001:db8::1", 4000)),
        ("gpu-7.example.org:4000", ("gpu-7.example.org", 4000)),
        (" 203.0.113.7:1 ", ("203.0.113.7", 1)),
    ],
)
def test_host_port_forms(text: str, parsed: tuple[str, int]) -> None:
    assert parse_host_port(text) == parsed


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("203.0.113.7", "must be HOST:PORT"),
        ("203.0.113.7:0", "port must be 1-65535"),
        ("203.0.113.7:65536", "port must be 1-65535"),
        ("2001:db8::1:4000", "must be HOST:PORT"),
        ("0.0.0.0:4000", "cannot be dialled"),
        ("224.0.0.1:4000", "cannot be dialled"),
        ("bad_host!:4000", "neither an IP address nor a host name"),
        ("[not-v6]:4000", "must be HOST:PORT"),
        ("", "must be HOST:PORT"),
    ],
)
def test_malformed_addresses_are_one_clear_error(text: str, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        parse_host_port(text)


def test_the_multiaddr_of_each_kind_of_host() -> None:
    assert Announced("203.0.113.7", 41234, "x").maddr == "/ip4/203.0.113.7/tcp/41234"
    assert Announced("2001:db8::1", 4000, "x").maddr == "/ip6/2001:db8::1/tcp/4000"
    assert Announced("gpu-7.example.org", 4000, "x").maddr == "/dns/gpu-7.example.org/tcp/4000"


def test_the_flag_wins_over_the_providers_variables() -> None:
    got = announced("192.0.2.1:5000", port=4000, env=VAST)
    assert got == Announced("192.0.2.1", 5000, "--announce")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (VAST, Announced("203.0.113.7", 41234, "vast.ai: PUBLIC_IPADDR and VAST_TCP_PORT_4000")),
        (RUNPOD, Announced("198.51.100.9", 18123, "RunPod: RUNPOD_PUBLIC_IP and RUNPOD_TCP_PORT_4000")),
    ],
    ids=["vast.ai", "runpod"],
)
def test_a_providers_mapping_of_the_listening_port_is_announced(env: dict[str, str], expected: Announced) -> None:
    assert announced(None, port=4000, env=env) == expected


@pytest.mark.parametrize(
    ("port", "env"),
    [
        (5000, VAST),  # the provider maps other ports, not this one
        (0, VAST),  # any free port: no mapping can point at it
        (4000, {"VAST_TCP_PORT_4000": "41234"}),  # no public IP said
        (4000, {"PUBLIC_IPADDR": "not an ip", "VAST_TCP_PORT_4000": "41234"}),
        (4000, {"PUBLIC_IPADDR": "203.0.113.7", "VAST_TCP_PORT_4000": "99999"}),
        (4000, {"PUBLIC_IPADDR": "203.0.113.7", "VAST_TCP_PORT_4000": "x"}),
        (4000, {}),
    ],
    ids=["other-port", "any-port", "no-ip", "bad-ip", "bad-external", "not-a-number", "no-provider"],
)
def test_without_a_usable_mapping_nothing_is_announced(port: int, env: dict[str, str]) -> None:
    assert announced(None, port=port, env=env) is None


def test_provider_ports_reads_only_port_mappings() -> None:
    env = {**VAST, **RUNPOD, "VAST_TCP_PORT_X": "1", "VAST_UDP_PORT_4000": "2", "RUNPOD_TCP_PORT_0": "3"}
    assert provider_ports(env) == {"vast.ai": {4000: 41234, 22: 41000}, "RunPod": {4000: 18123}}


def test_a_fixed_bulk_port_that_a_provider_maps_is_offered_at_its_external_port() -> None:
    from peer.boot.plan import bulk_settings

    env = {"PUBLIC_IPADDR": "203.0.113.7", "VAST_TCP_PORT_31338": "41002", "VAST_TCP_PORT_31337": "41001"}
    assert bulk_settings("31338", None, env).public_port == 41002
    assert bulk_settings("31338:5000", None, env).public_port == 5000  # the flag wins
    assert bulk_settings("31339", None, env).public_port == 0  # not mapped: the port itself
    assert bulk_settings("0", None, env).public_port == 0
    assert not bulk_settings("off", None, env).enabled
