"""The WAN simulator's pure parts (no root, no namespaces): names, rates, tc command lines."""

from __future__ import annotations

import pytest

from benchmarks import netsim
from benchmarks.netsim import (
    IFNAMSIZ_MAX,
    NotRootError,
    WanSim,
    host_addresses,
    make_names,
    parse_rate,
    tbf_burst_bytes,
    tbf_command,
)


def test_interface_names_fit_the_kernel_limit_and_are_unique() -> None:
    hosts = [f"peer-{i}" for i in range(253)]  # a full /24
    names = make_names("abcdefg", hosts)  # the longest prefix allowed
    ifnames = [names.bridge, *names.host_if.values(), *names.bridge_if.values()]
    assert all(len(n) <= IFNAMSIZ_MAX for n in ifnames)
    assert len(set(ifnames)) == len(ifnames)
    assert len(set(names.netns.values())) == len(hosts)
    assert all(n.startswith("abcdefg") for n in ifnames)
    assert names.links()[-1] == names.bridge


def test_names_are_deterministic_given_suffix_and_pid() -> None:
    names = make_names("stb", ["coord", "p0"], suffix="00af", pid=42)
    assert names.bridge == "stb00afbr"
    assert names.netns == {"coord": "stb-42-00af-coord", "p0": "stb-42-00af-p0"}
    assert names.host_if == {"coord": "stb00afh0", "p0": "stb00afh1"}
    assert names.bridge_if == {"coord": "stb00afb0", "p0": "stb00afb1"}


def test_two_instances_get_different_names() -> None:
    suffixes = {make_names("stb", ["a"]).suffix for _ in range(50)}
    assert len(suffixes) > 40  # 4 random hex digits: collisions are rare


@pytest.mark.parametrize("prefix", ["", "toolongxx", "Stb", "1ab", "s-b", "s b"])
def test_bad_prefix_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="invalid prefix"):
        make_names(prefix, ["a"])


@pytest.mark.parametrize("hosts", [[], ["a", "a"], ["a b"], ["x" * 33], ["-a"], "abc"])
def test_bad_hosts_are_refused(hosts: list[str]) -> None:
    with pytest.raises(ValueError):
        make_names("stb", hosts)


@pytest.mark.parametrize(
    ("rate", "bps"),
    [
        ("10mbit", 10_000_000),
        ("20Mbit", 20_000_000),
        ("512kbit", 512_000),
        ("1.5gbit", 1_500_000_000),
        (" 64 kbit ", 64_000),
        ("2000bit", 2_000),
        (5_000_000, 5_000_000),
    ],
)
def test_parse_rate(rate: str | int, bps: int) -> None:
    assert parse_rate(rate) == bps


@pytest.mark.parametrize(
    ("rate", "message"),
    [
        ("fast", "invalid rate 'fast'"),
        ("-1mbit", "invalid rate '-1mbit'"),
        ("0mbit", "at least"),
        ("10", "a unit is required"),
        ("10mbps", "use 'mbit'"),
        ("10furlongs", "known units"),
        ("", "invalid rate"),
        (0, "at least"),
        (-5, "at least"),
        (True, "invalid rate"),
        (1.5, "invalid rate"),
    ],
)
def test_bad_rates_are_refused_clearly(rate: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_rate(rate)  # type: ignore[arg-type]


def test_tbf_burst() -> None:
    assert tbf_burst_bytes(1_000_000) == 4_000  # the floor: 32 kbit
    assert tbf_burst_bytes(10_000_000) == 5_000  # 10 Mbit/s / 250 = 40 kbit
    assert tbf_burst_bytes(1_000_000_000) == 500_000
    assert all(tbf_burst_bytes(r) >= 1514 for r in (1_000, 64_000, 10**6))  # one full frame always fits


def test_tbf_command_lines() -> None:
    assert tbf_command("stb00afb0", 10_000_000) == [
        "tc", "qdisc", "replace", "dev", "stb00afb0", "root", "tbf",
        "rate", "10000000bit", "burst", "5000", "latency", "50ms",
    ]  # fmt: skip
    inside = tbf_command("stb00afh0", 5_000_000, netns="stb-42-00af-p0", tc="/usr/sbin/tc")
    assert inside[:3] == ["/usr/sbin/tc", "-n", "stb-42-00af-p0"]
    assert inside[3:] == tbf_command("stb00afh0", 5_000_000)[1:]


def test_host_addresses() -> None:
    bridge, hosts = host_addresses("10.77.0.0/24", 3)
    assert str(bridge) == "10.77.0.1/24"
    assert [str(h) for h in hosts] == ["10.77.0.2/24", "10.77.0.3/24", "10.77.0.4/24"]
    assert len(host_addresses("10.77.0.0/24", 253)[1]) == 253
    with pytest.raises(ValueError, match="room for 253"):
        host_addresses("10.77.0.0/24", 254)
    with pytest.raises(ValueError, match="invalid subnet"):
        host_addresses("10.77.0.1/24", 1)


def test_non_root_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netsim.os, "geteuid", lambda: 1000)
    with pytest.raises(NotRootError, match="needs root") as err:
        WanSim(hosts=["coord", "p0", "p1"], rate="20mbit")
    assert isinstance(err.value, RuntimeError)


def test_arguments_are_validated_before_the_root_check(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netsim.os, "geteuid", lambda: 1000)
    with pytest.raises(ValueError, match="invalid rate"):
        WanSim(hosts=["a"], rate="fast")
    with pytest.raises(ValueError, match="unknown hosts"):
        WanSim(hosts=["a"], rates={"b": "5mbit"})
    with pytest.raises(ValueError, match="invalid rate"):
        WanSim(hosts=["a"], rates={"a": "-1mbit"})


def test_missing_tool_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netsim.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netsim.shutil, "which", lambda *a, **k: None)
    with pytest.raises(netsim.NetSimError, match="needs 'ip'"):
        WanSim(hosts=["a"])


def test_a_stop_signal_during_teardown_stops_the_caller_once_teardown_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lab that runs several simulators in turn, stopped while one tears down, must not go on
    to its next run (a TERM during teardown was swallowed, and the benchmark started its next
    swarm)."""
    import signal

    monkeypatch.setattr(netsim.os, "geteuid", lambda: 0)
    monkeypatch.setattr(netsim.shutil, "which", lambda *a, **k: "/bin/true")
    sim = WanSim(hosts=["a"])
    monkeypatch.setattr(sim, "teardown", lambda: None)
    monkeypatch.setattr(sim, "_restore_signal_handlers", lambda: None)
    sim._tearing_down = True
    sim._on_signal(signal.SIGTERM, None)  # deferred: teardown goes on
    sim._tearing_down = False
    with pytest.raises(SystemExit) as stopped:
        sim.__exit__(None, None, None)
    assert stopped.value.code == 128 + signal.SIGTERM
    sim.__exit__(None, None, None)  # raised once
