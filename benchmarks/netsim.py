"""A small WAN simulator for benchmarks: network namespaces, one bridge, tbf rate limits, delays.

    python -m benchmarks.netsim --self-check [--rate 10mbit] [--seconds 2] [--delay-ms 40]
    python -m benchmarks.netsim --cleanup-stale PREFIX [--force]

Design
------
Every simulated host (peers, the coordinator, ...) gets its own Linux network namespace.
One Linux bridge lives in the root namespace; each host is attached to it by a veth pair,
one end inside the host's namespace and the other enslaved to the bridge::

    root namespace                                  namespace of host i
    +--------------------------------+              +------------------------+
    | bridge <P><S>br  10.77.0.1/24  |              |  lo (up)               |
    |   '-- <P><S>b<i> ==== veth ==================== <P><S>h<i>            |
    |       egress tbf = download    |              |  10.77.0.(i+2)/24      |
    +--------------------------------+              |  egress tbf = upload   |
                                                    +------------------------+

The host's link is rate limited in both directions with a token bucket filter (``tc qdisc
... tbf``), a root qdisc on the egress of each end of its veth: the end inside the namespace
shapes what the host sends (upload), the bridge-side end shapes what it receives (download).
Traffic between two hosts therefore runs at min(upload of the sender, download of the
receiver). The bridge has an address too, so the root namespace can reach every host (for
instance to read an HTTP port of a coordinator running in the simulator); that traffic is
shaped like any other.

Delay. ``delay_ms`` (every host) and ``delays`` (per host) add a one-way delay to a host's
link, in each direction, so a packet from A to B waits delay(A) + delay(B) and the RTT between
them is 2 * (delay(A) + delay(B)); the bridge itself adds none. There is no jitter or loss.
This kernel has no ``netem`` (nor ``fq``, which could hold packets to a BPF-set departure
time), so the delay is made in user space (``benchmarks.delay_link``): a host with a delay
gets two TAP devices instead of its veth pair, one in its namespace and one on the bridge,
with the same names, addresses and tbf qdiscs, and a forwarder process (stdlib Python, at
real-time priority) between them that writes every frame to the other side once it is
``delay`` old: rate limit first, then the delay. Hosts without a delay keep the plain veth, so
``delay_ms=0`` changes nothing. Precision: within about 1 ms per link (measured: +0.2-0.8 ms).

Why this and not vde2 (``dpipe vde_plug tap://.. = wirefilter -d MS = vde_plug tap://..``,
also tried): measured the same way (both hosts at 20 Mbit/s with 40 ms each; 2 cores; one
TCP stream for 5 s; both at SCHED_RR, without which a busy machine delays either by up to
90 ms), the two are alike: ping RTT 160.3-161.9 ms (160 configured), goodput 17.0 Mbit/s
(85%: BBR ramping up over a 160 ms RTT; the veth path gives 96%, the TAPs with no delay 94%),
5-7% of a core per delayed link. But vde2 takes 4 processes and an apt package per link,
copies 1514-byte frames through two pipes and leaves zombies behind ``dpipe``, where the
forwarder is one process per link that takes multi-segment TSO frames (``IFF_VNET_HDR``, half
the frames at these rates) and whose TAPs vanish when it exits. One process for all links
(another option) would share wakeups between links but not the per-frame cost, which
dominates, and would put every link on one core.

Cost and limits. The forwarder's cost goes with frames, not bytes or delay: about 40 us of
CPU per frame (user 24, system 15: the system part is mostly the kernel delivering the frame,
work a veth does too, in softirq), about 1,800 frames/s for one 20 Mbit/s TCP stream (data
frames of 3 KB on average, as many ACKs), and TCP's frames grow with its rate above ~25
Mbit/s. So a link saturates its forwarder's core at roughly 25,000 frames/s, i.e. some 300
Mbit/s of one-way TCP (an estimate: nothing above 20 Mbit/s was run here); 4 hosts at 50 Mbit/s
each way take about 0.6 of a core in forwarders and 8 such hosts about 1.3 cores. A larger
delay costs memory (rate * delay per direction), not CPU. TCP needs a window of rate * RTT:
the namespaces' defaults here (tcp_rmem max 32 MB, tcp_wmem max 4 MB, BBR) cover 100 Mbit/s
at a 300 ms RTT.

tbf's ``latency`` (50 ms) is not a delay either: it bounds how long a packet may queue in the
bucket before it is dropped, i.e. the queue length.

tbf counts whole Ethernet frames, so a TCP stream reaches about 95% of the configured rate as
goodput (1448 payload bytes per 1514-byte frame).

Names: namespaces are ``<prefix>-<pid>-<suffix>-<host>`` and links ``<prefix><suffix>br`` /
``<prefix><suffix>h<i>`` / ``<prefix><suffix>b<i>`` (at most 15 characters, the kernel's
limit), where ``suffix`` is 4 random hex digits, so two runs do not collide. The links in the
root namespace carry an alias ``netsim:<pid>`` naming the owning process; ``cleanup_stale``
uses it (and the pid in namespace names) to remove what a crashed run left behind without
touching the resources of a run that is still alive.

Teardown runs on normal exit, on an exception, on SIGINT/SIGTERM (while inside the ``with``
block, the handlers raise KeyboardInterrupt/SystemExit so ``__exit__`` runs; a signal that
the process ignored when the simulator started stays ignored) and from ``atexit`` as a last
resort. It kills the process group of every process started with ``WanSim.run`` (SIGTERM,
then SIGKILL after a grace period) and reaps it, stops the delay forwarders (their TAPs go
with them), kills anything else still running in the namespaces, deletes the veths, the
namespaces and the bridge. It is idempotent and logs
instead of raising when something is already gone.

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), ``ip`` and ``tc`` (iproute2). Stdlib only.
If ``br_netfilter`` is loaded with ``bridge-nf-call-iptables = 1``, bridged traffic also goes
through iptables' FORWARD chain: a DROP policy there (as Docker installs) would cut the hosts
off from each other.
"""

from __future__ import annotations

import argparse
import atexit
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any

from benchmarks.delay_link import DelayLink, start_delay_link, validate_delay_ms
from benchmarks.nat_router import HOST_INNER, ROUTER_INNER, ROUTER_NETNS_TAG, Nat, nft_ruleset
from protocol.pids import pid_alive

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_SUBNET",
    "IFNAMSIZ_MAX",
    "Nat",
    "NetSimError",
    "NotRootError",
    "SimNames",
    "WanSim",
    "cleanup_stale",
    "host_addresses",
    "make_names",
    "measure_rate",
    "new_suffix",
    "parse_rate",
    "tbf_burst_bytes",
    "tbf_command",
]

IFNAMSIZ_MAX = 15  # usable characters of a Linux interface name (IFNAMSIZ = 16 with the NUL)
DEFAULT_SUBNET = "10.77.0.0/24"
MIN_RATE_BPS = 1_000  # below 1 kbit/s the simulation is meaningless
MIN_BURST_BYTES = 4_000  # 32 kbit: comfortably above one 1514-byte frame
BURST_DIVISOR = 250  # burst >= what the bucket refills in 1/250 s (at least one tick at HZ <= 250)
TBF_LATENCY = "50ms"  # max queueing time in the bucket (the queue length), not a delay
CMD_TIMEOUT_S = 30.0
KILL_GRACE_S = 3.0
SELF_CHECK_RTTS = 25  # the self-check's TCP measurement lasts at least this many round trips
RTT_SLACK_S = 0.005  # the self-check's allowance for scheduling on top of the configured delay

_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,6}$")
_HOST_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,31}$")
_SUFFIX_RE = re.compile(r"^[0-9a-f]{4}$")
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_OWNER_ALIAS = "netsim:"


class NetSimError(RuntimeError):
    """The WAN simulator could not be set up (missing tool, a command failed, ...)."""


class NotRootError(NetSimError):
    """The WAN simulator needs root."""


# --------------------------------------------------------------------------- pure helpers


def parse_rate(rate: str | int) -> int:
    """A rate in bits/s from ``"20mbit"``, ``"512kbit"``, ``"1.5gbit"`` (SI units) or an int (bits/s).

    Raises ValueError for anything else, including tc's byte units (``"mbps"`` means megabytes
    per second to tc, a classic trap, so it is refused rather than guessed).
    """
    if isinstance(rate, bool):
        raise ValueError(f"invalid rate {rate!r}: expected e.g. '20mbit' or an int in bits/s")
    if isinstance(rate, int):
        bits = rate
    elif isinstance(rate, str):
        m = _RATE_RE.match(rate)
        if m is None:
            raise ValueError(
                f"invalid rate {rate!r}: expected a positive number with a unit, e.g. '20mbit', '512kbit', '1gbit'"
            )
        number, unit = m.group(1), m.group(2).lower()
        if unit not in _RATE_UNITS:
            if unit.endswith("bps"):
                hint = f"use '{unit[:-3]}bit' for bits/s ('{unit}' is bytes/s to tc and is not accepted)"
            elif not unit:
                hint = "a unit is required (bit, kbit, mbit, gbit, tbit)"
            else:
                hint = "known units: bit, kbit, mbit, gbit, tbit"
            raise ValueError(f"invalid rate {rate!r}: {hint}")
        bits = round(float(number) * _RATE_UNITS[unit])
    else:
        raise ValueError(f"invalid rate {rate!r}: expected e.g. '20mbit' or an int in bits/s")
    if bits < MIN_RATE_BPS:
        raise ValueError(f"invalid rate {rate!r}: must be at least {MIN_RATE_BPS} bit/s (1kbit)")
    return bits


def tbf_burst_bytes(rate_bps: int) -> int:
    """Bucket size for a rate: max(32 kbit, rate / 250) in bytes."""
    return max(MIN_BURST_BYTES, math.ceil(rate_bps / 8 / BURST_DIVISOR))


def tbf_command(dev: str, rate_bps: int, *, netns: str | None = None, tc: str = "tc") -> list[str]:
    """The argv that makes ``tbf`` at ``rate_bps`` the root qdisc of ``dev`` (in ``netns`` if given)."""
    argv = [tc]
    if netns is not None:
        argv += ["-n", netns]
    argv += [
        "qdisc", "replace", "dev", dev, "root", "tbf",
        "rate", f"{rate_bps}bit",
        "burst", str(tbf_burst_bytes(rate_bps)),
        "latency", TBF_LATENCY,
    ]  # fmt: skip
    return argv


def new_suffix() -> str:
    """4 random hex digits."""
    return secrets.token_hex(2)


@dataclass(frozen=True)
class SimNames:
    """Kernel object names of one simulator instance."""

    prefix: str
    suffix: str
    pid: int
    bridge: str
    netns: dict[str, str]  # host -> namespace
    host_if: dict[str, str]  # host -> veth end inside the namespace
    bridge_if: dict[str, str]  # host -> veth end on the bridge

    def links(self) -> list[str]:
        """Every link name in the root namespace, the bridge last."""
        return [self.bridge_if[h] for h in self.netns] + [self.bridge]


def make_names(prefix: str, hosts: Sequence[str], *, suffix: str | None = None, pid: int | None = None) -> SimNames:
    """Names for a simulator with ``hosts``; validates the prefix and the host names."""
    _check_prefix(prefix)
    validate_hosts(hosts)
    suffix = new_suffix() if suffix is None else suffix
    if not _SUFFIX_RE.match(suffix):
        raise ValueError(f"invalid suffix {suffix!r}: 4 lowercase hex digits")
    pid = os.getpid() if pid is None else pid
    stem = prefix + suffix
    names = SimNames(
        prefix=prefix,
        suffix=suffix,
        pid=pid,
        bridge=f"{stem}br",
        netns={h: f"{prefix}-{pid}-{suffix}-{h}" for h in hosts},
        host_if={h: f"{stem}h{i}" for i, h in enumerate(hosts)},
        bridge_if={h: f"{stem}b{i}" for i, h in enumerate(hosts)},
    )
    for name in [names.bridge, *names.host_if.values(), *names.bridge_if.values()]:
        if len(name) > IFNAMSIZ_MAX:  # cannot happen with the checks above; kept as a guard
            raise ValueError(f"interface name {name!r} is longer than {IFNAMSIZ_MAX} characters")
    return names


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix):
        raise ValueError(
            f"invalid prefix {prefix!r}: 1-7 characters, lowercase letters and digits, starting with a letter"
        )


def validate_hosts(hosts: Sequence[str]) -> None:
    if isinstance(hosts, str) or not hosts:
        raise ValueError("hosts must be a non-empty list of host names")
    for h in hosts:
        if not isinstance(h, str) or not _HOST_RE.match(h):
            raise ValueError(f"invalid host name {h!r}: 1-32 characters of letters, digits, '_', '.', '-'")
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"duplicate host names in {list(hosts)}")


def host_addresses(subnet: str, n_hosts: int) -> tuple[ipaddress.IPv4Interface, list[ipaddress.IPv4Interface]]:
    """(bridge address, host addresses): .1 for the bridge, .(i+2) for host i, with the subnet's prefix length."""
    try:
        net = ipaddress.IPv4Network(subnet, strict=True)
    except ValueError as e:
        raise ValueError(f"invalid subnet {subnet!r}: {e}") from None
    if n_hosts > net.num_addresses - 3:  # network, bridge and broadcast addresses are taken
        raise ValueError(f"subnet {subnet} has room for {max(0, net.num_addresses - 3)} hosts, not {n_hosts}")
    base = int(net.network_address)
    bridge = ipaddress.IPv4Interface(f"{ipaddress.IPv4Address(base + 1)}/{net.prefixlen}")
    hosts = [ipaddress.IPv4Interface(f"{ipaddress.IPv4Address(base + 2 + i)}/{net.prefixlen}") for i in range(n_hosts)]
    return bridge, hosts


# --------------------------------------------------------------------------- system helpers


def _require_root() -> None:
    if os.geteuid() != 0:
        raise NotRootError("the WAN simulator needs root (network namespaces): run it with sudo")


def _find_tool(name: str, package: str = "iproute2") -> str:
    path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin:/usr/bin:/bin")
    if path is None:
        raise NetSimError(f"the WAN simulator needs '{name}' ({package}), which is not installed or not on PATH")
    return path


def _run_cmd(argv: Sequence[str], *, check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    log.debug("$ %s", " ".join(argv))
    try:
        proc = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=CMD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        if check:
            raise NetSimError(f"{' '.join(argv)}: {e}") from e
        log.warning("%s: %s", " ".join(argv), e)
        return subprocess.CompletedProcess(list(argv), -1, "", str(e))
    if check and proc.returncode != 0:
        raise NetSimError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def _list_netns(ip: str) -> list[str]:
    proc = _run_cmd([ip, "netns", "list"], check=False)
    # lines look like "name" or "name (id: 3)"
    return [line.split()[0] for line in proc.stdout.splitlines() if line.strip()]


def _list_links(ip: str) -> dict[str, str]:
    """Root-namespace links: name -> alias ('' when none)."""
    proc = _run_cmd([ip, "-j", "link", "show"], check=False)
    try:
        entries = json.loads(proc.stdout or "[]")
    except json.JSONDecodeError:
        log.warning("could not parse `ip -j link show` output")
        return {}
    return {e["ifname"]: e.get("ifalias", "") for e in entries if "ifname" in e}


def _kill_netns_pids(ip: str, netns: str) -> None:
    proc = _run_cmd([ip, "netns", "pids", netns], check=False)
    for token in proc.stdout.split():
        if token.isdigit() and int(token) != os.getpid():
            try:
                with open(f"/proc/{token}/cmdline", "rb") as proc_cmdline:
                    command = proc_cmdline.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                command = "?"
            log.warning("killing leftover process %s in namespace %s: %s", token, netns, command.strip()[:200])
            try:
                os.kill(int(token), signal.SIGKILL)
            except ProcessLookupError:
                pass


def cleanup_stale(prefix: str, *, force: bool = False) -> list[str]:
    """Remove namespaces and links left behind by crashed runs that used ``prefix``.

    Only resources whose owning process is gone are removed, unless ``force`` (then every
    simulator resource with this prefix goes, including a live run's). Processes still running
    inside a removed namespace are killed. Returns the names removed.
    """
    _check_prefix(prefix)
    _require_root()
    ip = _find_tool("ip")
    me = os.getpid()
    ns_re = re.compile(rf"^{prefix}-(\d+)-([0-9a-f]{{4}})-.+$")
    link_re = re.compile(rf"^{prefix}([0-9a-f]{{4}})(br|b\d+|h\d+)$")

    def stale(pid: int) -> bool:
        return force or (pid != me and not pid_alive(pid))

    removed: list[str] = []
    live_suffixes: set[str] = set()
    for ns in _list_netns(ip):
        m = ns_re.match(ns)
        if m is None:
            continue
        if not stale(int(m.group(1))):
            live_suffixes.add(m.group(2))
            log.info("keeping namespace %s: its owner (pid %s) is alive", ns, m.group(1))
            continue
        _kill_netns_pids(ip, ns)
        if _run_cmd([ip, "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    links = _list_links(ip)
    # veth ends before bridges: deleting a veth end also removes its peer
    for name in sorted(links, key=lambda n: n.endswith("br")):
        m = link_re.match(name)
        if m is None or m.group(1) in live_suffixes:
            continue
        alias = links[name]
        if alias.startswith(_OWNER_ALIAS) and alias[len(_OWNER_ALIAS) :].isdigit():
            if not stale(int(alias[len(_OWNER_ALIAS) :])):
                log.info("keeping link %s: its owner (%s) is alive", name, alias)
                continue
        if _run_cmd([ip, "link", "del", name], check=False).returncode == 0:
            removed.append(name)
    for name in removed:
        log.info("removed stale %s", name)
    return removed


# --------------------------------------------------------------------------- the simulator


class WanSim:
    """Hosts in network namespaces on one bridge, each link rate limited both ways.

    >>> with WanSim(hosts=["coord", "p0", "p1"], rate="20mbit", rates={"p0": "5mbit"}, delay_ms=10) as sim:
    ...     proc = sim.run("p0", ["python3", "-m", "http.server", "--bind", sim.ip("p0")])
    ...     print(sim.exec("p1", ["ip", "-br", "addr"]).stdout)

    ``rate`` applies to every host in both directions unless ``rates`` overrides it for a host;
    likewise ``delay_ms``, a one-way delay in milliseconds added on a host's link in each
    direction, and ``delays`` (0: a plain veth, no forwarder). The RTT between hosts A and B is
    2 * (delay(A) + delay(B)).
    """

    def __init__(
        self,
        hosts: Sequence[str],
        rate: str | int = "20mbit",
        *,
        rates: Mapping[str, str | int] | None = None,
        prefix: str = "stb",
        subnet: str = DEFAULT_SUBNET,
        kill_grace_s: float = KILL_GRACE_S,
        nat: Mapping[str, Nat] | None = None,
        delay_ms: float = 0.0,
        delays: Mapping[str, float] | None = None,
    ) -> None:
        hosts = list(hosts)
        validate_hosts(hosts)
        self.nat: dict[str, Nat] = dict(nat or {})
        unknown_nat = sorted(set(self.nat) - set(hosts))
        if unknown_nat:
            raise ValueError(f"NAT given for unknown hosts {unknown_nat}; hosts are {hosts}")
        default_bps = parse_rate(rate)
        rates = dict(rates or {})
        unknown = sorted(set(rates) - set(hosts))
        if unknown:
            raise ValueError(f"rates given for unknown hosts {unknown}; hosts are {hosts}")
        default_delay = validate_delay_ms(delay_ms)
        delays = dict(delays or {})
        unknown = sorted(set(delays) - set(hosts))
        if unknown:
            raise ValueError(f"delays given for unknown hosts {unknown}; hosts are {hosts}")
        self.hosts: list[str] = hosts
        self.delays_ms: dict[str, float] = {
            h: validate_delay_ms(delays[h], f"delay for host {h!r}") if h in delays else default_delay for h in hosts
        }
        self.rates_bps: dict[str, int] = {h: parse_rate(rates[h]) if h in rates else default_bps for h in hosts}
        self.subnet = subnet
        self.bridge_addr, addrs = host_addresses(subnet, len(hosts))
        self._addrs: dict[str, ipaddress.IPv4Interface] = dict(zip(hosts, addrs, strict=True))
        self.names: SimNames = make_names(prefix, hosts)  # validates the prefix
        self.kill_grace_s = kill_grace_s
        _require_root()
        self._ip = _find_tool("ip")
        self._tc = _find_tool("tc")
        self._nft = _find_tool("nft", "nftables") if self.nat else ""

        self._lock = threading.RLock()
        self._active = False
        self._tearing_down = False
        self._torn_down = False
        self._deferred_signal: int | None = None
        """A SIGINT/SIGTERM that came during teardown: raised once it is done (``__exit__``)."""
        self._created_links: list[str] = []
        self._created_netns: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._delay_links: dict[str, DelayLink] = {}
        self._prev_handlers: dict[int, Any] = {}

    # ----------------------------------------------------------------- public API

    def ip(self, host: str) -> str:
        """The IPv4 address of ``host`` on the bridge: its router's for a host behind NAT."""
        return str(self._addrs[self._check_host(host)].ip)

    def inner_ip(self, host: str) -> str:
        """The address ``host`` has on its own interface: ``ip(host)``, or its private one behind NAT."""
        return str(HOST_INNER.ip) if self._check_host(host) in self.nat else self.ip(host)

    def netns(self, host: str) -> str:
        """The network namespace of ``host``."""
        return self.names.netns[self._check_host(host)]

    def router_netns(self, host: str) -> str:
        """The namespace of the NAT router in front of ``host`` (a host given a ``Nat``)."""
        if self._check_host(host) not in self.nat:
            raise KeyError(f"host {host!r} is not behind NAT")
        return self.names.netns[host] + ROUTER_NETNS_TAG

    def delay_cpu_seconds(self) -> dict[str, float]:
        """CPU seconds used so far by the delay forwarder of each host that has a delay."""
        with self._lock:
            links = dict(self._delay_links)
        return {h: link.cpu_seconds() for h, link in links.items()}

    def run(self, host: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``'s namespace, in a new session (its own process group).

        Keyword arguments go to ``subprocess.Popen``. The process group is killed at teardown.
        """
        if not self._active:
            raise NetSimError("WanSim.run() outside the `with` block")
        popen_kwargs.pop("start_new_session", None)
        cmd = [self._ip, "netns", "exec", self.netns(host), *argv]
        log.debug("run on %s: %s", host, " ".join(map(str, argv)))
        with self._lock:
            proc: subprocess.Popen[Any] = subprocess.Popen(cmd, start_new_session=True, **popen_kwargs)
            self._procs.append(proc)
        return proc

    def exec(
        self, host: str, argv: Sequence[str], *, check: bool = False, timeout: float | None = 60.0, **run_kwargs: Any
    ) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` to completion inside ``host``'s namespace (output captured as text by default)."""
        if not self._active:
            raise NetSimError("WanSim.exec() outside the `with` block")
        run_kwargs.setdefault("capture_output", True)
        run_kwargs.setdefault("text", True)
        cmd = [self._ip, "netns", "exec", self.netns(host), *argv]
        return subprocess.run(cmd, check=check, timeout=timeout, **run_kwargs)

    def __enter__(self) -> WanSim:
        if self._active or self._torn_down:
            raise NetSimError("a WanSim can be entered only once")
        self._install_signal_handlers()
        atexit.register(self._atexit_teardown)
        try:
            self._setup()
        except BaseException:
            self.teardown()
            self._restore_signal_handlers()
            atexit.unregister(self._atexit_teardown)
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self.teardown()
        except BaseException:  # a signal landed before teardown() got going: finish the job, then re-raise
            self.teardown()
            raise
        finally:
            self._restore_signal_handlers()
            if self._torn_down:
                atexit.unregister(self._atexit_teardown)
        deferred, self._deferred_signal = self._deferred_signal, None
        if deferred is not None and exc_type is None:  # the caller meant to stop: not go on to its next run
            if deferred == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + deferred)

    def teardown(self) -> None:
        """Kill started processes, delete veths, namespaces and the bridge. Idempotent, never raises."""
        with self._lock:
            if self._torn_down or self._tearing_down:
                return
            self._tearing_down = True
        try:
            self._active = False
            self._kill_procs()
            self._stop_delay_links()  # their TAPs disappear with them
            for ns in self._created_netns:
                _kill_netns_pids(self._ip, ns)
            # only what this instance created: a name clash at setup must not delete another run's links
            existing = set(_list_links(self._ip))
            for link in self._created_links:
                if link != self.names.bridge and link in existing:
                    self._del_quiet([self._ip, "link", "del", link])  # removes the peer in the namespace too
            for ns in list(self._created_netns):
                self._del_quiet([self._ip, "netns", "del", ns])
            if self.names.bridge in self._created_links and self.names.bridge in set(_list_links(self._ip)):
                self._del_quiet([self._ip, "link", "del", self.names.bridge])
            left = self.leftovers()
            if left:
                log.warning("teardown left behind: %s", ", ".join(left))
            else:
                log.info("WAN simulator %s%s torn down", self.names.prefix, self.names.suffix)
        except BaseException:  # teardown must not raise: it runs from __exit__, signal paths and atexit
            log.exception("WAN simulator teardown failed")
        finally:
            self._created_netns.clear()
            self._created_links.clear()
            self._torn_down = True
            self._tearing_down = False

    def leftovers(self) -> list[str]:
        """Namespaces and links of this instance that still exist (empty after a clean teardown)."""
        netns = set(_list_netns(self._ip))
        links = set(_list_links(self._ip))
        return [n for n in self.names.netns.values() if n in netns] + [n for n in self.names.links() if n in links]

    # ----------------------------------------------------------------- internals

    def _check_host(self, host: str) -> str:
        if host not in self._addrs:
            raise KeyError(f"unknown host {host!r}; hosts are {self.hosts}")
        return host

    def _setup(self) -> None:
        # what a run with this prefix left behind when it was killed (SIGKILL skips teardown)
        # holds the subnet: its owner is gone, so it goes (a live run's stays: the check below)
        removed = cleanup_stale(self.names.prefix)
        if removed:
            log.warning("removed what a killed run with prefix %r left: %s", self.names.prefix, ", ".join(removed))
        self._check_subnet_free()
        self._check_names_free()
        ip, n = self._ip, self.names
        alias = f"{_OWNER_ALIAS}{n.pid}"
        _run_cmd([ip, "link", "add", n.bridge, "type", "bridge"])
        self._created_links.append(n.bridge)
        _run_cmd([ip, "link", "set", n.bridge, "alias", alias])
        _run_cmd([ip, "addr", "add", str(self.bridge_addr), "dev", n.bridge])
        _run_cmd([ip, "link", "set", n.bridge, "up"])
        for i, host in enumerate(self.hosts):
            ns, hif, bif = n.netns[host], n.host_if[host], n.bridge_if[host]
            _run_cmd([ip, "netns", "add", ns])
            self._created_netns.append(ns)
            if host in self.nat:  # the bridge's veth ends in the router's namespace, the host behind it
                ns = self.router_netns(host)
                _run_cmd([ip, "netns", "add", ns])
                self._created_netns.append(ns)
            if self.delays_ms[host] > 0:  # two TAPs and a forwarder in ns instead of the veth pair
                self._start_delay_link(host, ns)
            else:
                _run_cmd([ip, "link", "add", bif, "type", "veth", "peer", "name", hif, "netns", ns])
            self._created_links.append(bif)
            _run_cmd([ip, "link", "set", bif, "alias", alias])
            _run_cmd([ip, "link", "set", bif, "master", n.bridge])
            _run_cmd([ip, "link", "set", bif, "up"])
            _run_cmd([ip, "-n", ns, "link", "set", "lo", "up"])
            _run_cmd([ip, "-n", ns, "addr", "add", str(self._addrs[host]), "dev", hif])
            _run_cmd([ip, "-n", ns, "link", "set", hif, "up"])
            bps = self.rates_bps[host]
            _run_cmd(tbf_command(hif, bps, netns=ns, tc=self._tc))  # upload
            _run_cmd(tbf_command(bif, bps, tc=self._tc))  # download
            if host in self.nat:
                self._setup_router(host, i)
        self._active = True
        log.info(
            "WAN simulator up: bridge %s %s; %s",
            n.bridge,
            self.bridge_addr,
            ", ".join(
                f"{h}={self.ip(h)}@{self.rates_bps[h]}bit/s"
                + (f"+{self.delays_ms[h]:g}ms" if self.delays_ms[h] else "")
                for h in self.hosts
            ),
        )
        self._check_bridge_netfilter()

    def _start_delay_link(self, host: str, ns: str) -> None:
        """The forwarder of ``host``: its TAP in ``ns`` and its TAP on the bridge side, both still unconfigured."""
        n = self.names
        try:
            link = start_delay_link(
                netns=ns,
                host_tap=n.host_if[host],
                bridge_tap=n.bridge_if[host],
                delay_ms=self.delays_ms[host],
                ip=self._ip,
                verbose=log.isEnabledFor(logging.DEBUG),
            )
        except (OSError, RuntimeError) as e:
            raise NetSimError(f"delay link of host {host!r}: {e}") from e
        with self._lock:
            self._delay_links[host] = link

    def _setup_router(self, host: str, index: int) -> None:
        """The private link from ``host``'s router to the host, forwarding and the NAT rules."""
        ip, n = self._ip, self.names
        router, inside = self.router_netns(host), n.netns[host]
        rif, lif = f"{n.prefix}{n.suffix}r{index}", f"{n.prefix}{n.suffix}l{index}"
        _run_cmd([ip, "-n", router, "link", "add", rif, "type", "veth", "peer", "name", lif, "netns", inside])
        _run_cmd([ip, "-n", router, "addr", "add", str(ROUTER_INNER), "dev", rif])
        _run_cmd([ip, "-n", router, "link", "set", rif, "up"])
        _run_cmd([ip, "-n", inside, "link", "set", "lo", "up"])
        _run_cmd([ip, "-n", inside, "addr", "add", str(HOST_INNER), "dev", lif])
        _run_cmd([ip, "-n", inside, "link", "set", lif, "up"])
        _run_cmd([ip, "-n", inside, "route", "add", "default", "via", str(ROUTER_INNER.ip)])
        _run_cmd([ip, "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        ruleset = nft_ruleset(self.nat[host], public_if=n.host_if[host], inner_if=rif)
        _run_cmd([ip, "netns", "exec", router, self._nft, "-f", "-"], stdin=ruleset)

    def _check_subnet_free(self) -> None:
        net = ipaddress.IPv4Network(self.subnet)
        proc = _run_cmd([self._ip, "-j", "-4", "addr", "show"])
        for entry in json.loads(proc.stdout or "[]"):
            for a in entry.get("addr_info", []):
                other = ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False)
                if other.overlaps(net):
                    raise NetSimError(
                        f"subnet {self.subnet} overlaps {a['local']}/{a['prefixlen']} on {entry.get('ifname')} "
                        "(another simulator running?): pass a different subnet="
                    )

    def _check_names_free(self) -> None:
        taken = set(_list_netns(self._ip)) | set(_list_links(self._ip))
        clash = [n for n in [*self.names.netns.values(), *self.names.links()] if n in taken]
        if clash:  # 1 in 65536 per prefix: try again rather than guessing around it
            raise NetSimError(f"names already in use: {clash}; retry or run cleanup_stale()")

    def _check_bridge_netfilter(self) -> None:
        try:
            with open("/proc/sys/net/bridge/bridge-nf-call-iptables") as f:
                if f.read().strip() == "1":
                    log.debug("br_netfilter is active: bridged traffic traverses iptables FORWARD")
        except OSError:
            pass

    def _del_quiet(self, argv: list[str]) -> None:
        proc = _run_cmd(argv, check=False)
        if proc.returncode != 0:
            log.info("%s: %s", " ".join(argv), proc.stderr.strip())

    def _kill_procs(self) -> None:
        with self._lock:
            procs = list(self._procs)
        if not procs:
            return
        for proc in procs:
            _killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.kill_grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in procs:  # the whole group, including children that outlived the leader
            _killpg(proc.pid, signal.SIGKILL)
        for proc in procs:
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                log.warning("process %s did not exit after SIGKILL", proc.pid)

    def _stop_delay_links(self) -> None:
        with self._lock:
            links = list(self._delay_links.values())
            self._delay_links.clear()
        for link in links:
            link.stop(self.kill_grace_s)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.debug("not in the main thread: SIGINT/SIGTERM teardown relies on the caller")
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            prev = signal.getsignal(sig)
            if prev == signal.SIG_IGN:  # e.g. a background job or nohup: keep ignoring it
                continue
            self._prev_handlers[sig] = prev
            signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, prev in self._prev_handlers.items():
            try:
                signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
            except (ValueError, TypeError, OSError) as e:
                log.warning("could not restore the handler of signal %s: %s", sig, e)
        self._prev_handlers.clear()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._tearing_down:
            log.warning("signal %s during teardown: finishing teardown first", signum)
            self._deferred_signal = signum
            return
        log.info("signal %s: tearing down the WAN simulator", signum)
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _atexit_teardown(self) -> None:
        if not self._torn_down:
            log.warning("WAN simulator still up at interpreter exit: tearing it down")
            self.teardown()


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
    except PermissionError as e:
        log.warning("cannot signal process group %s: %s", pgid, e)


# --------------------------------------------------------------------------- measurement

_SINK = r"""
import socket, sys, time
srv = socket.socket()
srv.bind((sys.argv[1], 0))
srv.listen(1)
srv.settimeout(float(sys.argv[2]))
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.settimeout(float(sys.argv[2]))
first = conn.recv(1 << 16)
t0 = t1 = time.monotonic()
n = 0
while True:
    b = conn.recv(1 << 16)
    if not b:
        break
    n += len(b)
    t1 = time.monotonic()
print(n, t1 - t0, flush=True)
"""

_SOURCE = r"""
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
buf = b"\0" * (1 << 16)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    s.sendall(buf)
s.shutdown(socket.SHUT_WR)
s.recv(1)
s.close()
"""


_PING = r"""
import os, socket, struct, sys, time
dst, count, timeout, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
ident = os.getpid() & 0xFFFF
def checksum(b):
    t = sum(struct.unpack(f"!{len(b) // 2}H", b))
    t = (t >> 16) + (t & 0xFFFF)
    return ~(t + (t >> 16)) & 0xFFFF
for seq in range(count):
    head = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
    payload = b"netsim-rtt-probe" * 3
    packet = head[:2] + struct.pack("!H", checksum(head + payload)) + head[4:] + payload
    t0 = time.monotonic()
    s.sendto(packet, (dst, 0))
    rtt = -1.0
    while (left := t0 + timeout - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            data, addr = s.recvfrom(4096)
        except socket.timeout:
            break
        ihl = (data[0] & 15) * 4
        kind, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl : ihl + 8])
        if kind == 0 and rid == ident and rseq == seq and addr[0] == dst:
            rtt = time.monotonic() - t0
            break
    print(rtt, flush=True)
    time.sleep(max(0.0, t0 + interval - time.monotonic()))
"""


def measure_rtt(sim: WanSim, a: str, b: str, count: int = 5, *, timeout: float = 2.0) -> list[float | None]:
    """Round-trip times in seconds of ``count`` ICMP echoes from host ``a`` to host ``b`` (None: lost).

    Stdlib only (a raw socket inside ``a``'s namespace), so it needs no ``ping`` binary. One
    echo at a time, each waiting up to ``timeout`` for its reply, at most one every 0.2 s.
    """
    interval = 0.2
    proc = sim.exec(
        a,
        [sys.executable, "-c", _PING, sim.ip(b), str(count), str(timeout), str(interval)],
        timeout=count * (timeout + interval) + 30.0,
    )
    if proc.returncode != 0:
        raise NetSimError(f"measure_rtt: the prober on {a} failed (rc {proc.returncode}): {proc.stderr.strip()}")
    rtts = [float(line) for line in proc.stdout.split()]
    return [None if r < 0 else r for r in rtts]


def measure_rate(sim: WanSim, a: str, b: str, seconds: float = 2.0) -> float:
    """Goodput in bits/s of one TCP stream from host ``a`` to host ``b`` over ``seconds``.

    Measured at the receiver, from its first chunk to end of stream (so the sender's socket
    buffer, drained after it stops, is counted with the time it took).
    """
    timeout = seconds + 30.0
    sink = sim.run(b, [sys.executable, "-c", _SINK, sim.ip(b), str(timeout)], stdout=subprocess.PIPE, text=True)
    try:
        assert sink.stdout is not None
        port_line = sink.stdout.readline().strip()
        if not port_line.isdigit():
            raise NetSimError(f"measure_rate: the receiver on {b} did not start (got {port_line!r})")
        source = sim.run(a, [sys.executable, "-c", _SOURCE, sim.ip(b), port_line, str(seconds), str(timeout)])
        if source.wait(timeout=timeout) != 0:
            raise NetSimError(f"measure_rate: the sender on {a} failed (rc {source.returncode})")
        out, _ = sink.communicate(timeout=timeout)
        if sink.returncode != 0:
            raise NetSimError(f"measure_rate: the receiver on {b} failed (rc {sink.returncode})")
        nbytes, elapsed = out.split()
        return int(nbytes) * 8 / float(elapsed)
    finally:
        if sink.poll() is None:
            sink.kill()


# --------------------------------------------------------------------------- self-check


def _self_check(rate: str, seconds: float, prefix: str, delay_ms: float = 0.0) -> int:
    configured = parse_rate(rate)
    sim = WanSim(hosts=["a", "b"], rate=rate, prefix=prefix, delay_ms=delay_ms)
    expected_rtt = 4 * sim.delays_ms["a"] / 1e3  # a -> bridge -> b and back: two delayed links, twice each
    if seconds < SELF_CHECK_RTTS * expected_rtt:  # TCP's ramp-up takes a few RTTs: keep it a small part
        seconds = SELF_CHECK_RTTS * expected_rtt
        print(f"measuring {seconds:.1f} s per direction ({SELF_CHECK_RTTS} round trips)")
    ok = True
    with sim:
        rtts = measure_rtt(sim, "a", "b", count=5)
        got = sorted(r for r in rtts if r is not None)
        if not got:
            print("ping a -> b: FAILED (no reply)")
            ok = False
        else:  # the minimum: the first echo also waits for ARP, a loaded machine adds scheduling delays
            good = expected_rtt * 0.98 <= got[0] <= expected_rtt * 1.10 + RTT_SLACK_S
            ok &= good
            print(
                f"ping a -> b: rtt min/median/max {got[0] * 1e3:.1f}/{got[len(got) // 2] * 1e3:.1f}/{got[-1] * 1e3:.1f} ms, "
                f"{len(got)}/{len(rtts)} answered (expected {expected_rtt * 1e3:.1f} ms) {'ok' if good else 'OUT OF RANGE'}"
            )
        for src, dst in (("a", "b"), ("b", "a")):
            cpu0, t0 = sim.delay_cpu_seconds(), time.monotonic()
            bps = measure_rate(sim, src, dst, seconds)
            cpu1, elapsed = sim.delay_cpu_seconds(), time.monotonic() - t0
            share = bps / configured
            good = 0.70 <= share <= 1.05
            ok &= good
            verdict = "ok" if good else "OUT OF RANGE"
            cpu = "".join(f", forwarder {h} {(cpu1[h] - cpu0[h]) / elapsed:.0%} CPU" for h in sorted(cpu1))
            print(f"{src} -> {dst}: {bps / 1e6:.2f} Mbit/s of {configured / 1e6:.2f} ({share:.0%}) {verdict}{cpu}")
    left = sim.leftovers()
    ip = _find_tool("ip")
    others = [n for n in _list_netns(ip) if n.startswith(f"{prefix}-")]
    others += [n for n in _list_links(ip) if re.match(rf"^{prefix}[0-9a-f]{{4}}(br|b\d+|h\d+)$", n)]
    if left:
        print(f"teardown: LEFT BEHIND {left}")
        ok = False
    else:
        print("teardown: nothing left behind")
    if others:
        print(f"note: other resources with prefix {prefix!r} exist (another run, or stale: --cleanup-stale {prefix})")
    print("self-check", "passed" if ok else "FAILED")
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.netsim", description=__doc__.split("\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--self-check", action="store_true", help="2 hosts, measure the rate, tear down, verify")
    action.add_argument("--cleanup-stale", metavar="PREFIX", help="remove leftovers of crashed runs with PREFIX")
    parser.add_argument("--rate", default="10mbit")
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay added on each host's link")
    parser.add_argument("--prefix", default="stbchk")
    parser.add_argument("--force", action="store_true", help="with --cleanup-stale: also remove live runs' resources")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.cleanup_stale:
            removed = cleanup_stale(args.cleanup_stale, force=args.force)
            print(f"removed {len(removed)}: {' '.join(removed)}" if removed else "nothing to remove")
            return 0
        return _self_check(args.rate, args.seconds, args.prefix, args.delay_ms)
    except NotRootError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (NetSimError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
