"""A user-space delay element for one simulated host link: two TAP devices and a forwarder.

The kernel here has no ``netem``, so ``benchmarks.netsim`` adds one-way delay in user space.
For a host with a delay, its veth pair is replaced by two TAP devices joined by one process::

    root namespace                          namespace of the host (or of its NAT router)
    bridge -- <P><S>b<i> (TAP, tbf) ==== forwarder ==== <P><S>h<i> (TAP, tbf, address)

The forwarder runs inside the host's namespace (started with ``ip netns exec``) and holds both
TAPs open: it creates the host-side TAP itself and the bridge-side one on a ``/dev/net/tun``
descriptor that the parent opened in the root namespace and passed down (a TAP is created in
the namespace the descriptor was opened in). Every frame read from one TAP is written to the
other ``delay`` later: one FIFO of (release time, frame) per direction, so frames keep their
order. Both TAPs are opened with ``IFF_VNET_HDR`` and offloads on (checksum, TSO), so the
kernel may hand over a TCP segment train as one frame with a virtio-net header, which the
forwarder passes on untouched. How big those frames are is up to the sender's TCP (its TSO
autosizing sends about 1 ms of its pacing rate per frame, at least 2 segments): measured here
about 3 KB on average and 5.9 KB at most at 5-20 Mbit/s, i.e. half the frames of 1514-byte ones.

The tbf qdiscs stay where the veth had them (the egress of each end), so rate limiting comes
first and the delay after it, as on a real path (the bottleneck queue, then the propagation).
tbf shapes a multi-segment frame by its full length (one longer than tbf's bucket is cut into
segments by tbf itself): a stream through the TAPs gets 94-95% of the rate as goodput, as
through a veth.

Timing. Frames are released up to ``slack`` (0.5 ms) before they are due, so one wakeup sends
several. Idle, the forwarder blocks until a frame arrives and stamps it exactly; while frames
are in flight it looks for new ones at most once per ``tick`` (1 ms) and stamps what it finds
with the middle of the interval it did not look, so wakeups stay near 1,000/s (plus releases)
however many frames pass: on this machine a Python wakeup costs more than a frame. A frame's
delay is thus exact to about +-0.5 ms per link. It runs at real-time priority (SCHED_RR 10):
as a normal process on a busy machine it was woken up to 90 ms late, which made the RTT
jitter and the late bursts overflow the next tbf; at SCHED_RR no frame left more than 0.7 ms
after it was due. Its CPU use is small (see ``benchmarks.netsim``), and the kernel keeps about
5% of each core for normal tasks even if a real-time task spun.

The TAPs are not persistent: they exist while the forwarder holds them, so stopping (or
killing) the forwarder removes both. A forwarder whose parent died exits within a second
(the parent changed), and ``cleanup_stale`` kills any process left in a simulator namespace.
Handshake: the forwarder prints one line, ``ready`` or ``error <why>``, on stdout and nothing
else there afterwards; logs go to stderr (with ``--verbose``, its counters when it stops).

Linux only, stdlib only; the TAP side needs root (CAP_NET_ADMIN). ``DelayQueue`` and
``Forwarder`` work on any file descriptors (the unit tests use socket pairs).

    python benchmarks/delay_link.py --host-tap NAME --bridge-tap NAME --bridge-fd FD --delay-ms MS
"""

from __future__ import annotations

import argparse
import collections
import errno
import fcntl
import logging
import math
import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

__all__ = [
    "MAX_DELAY_MS",
    "DelayLink",
    "DelayQueue",
    "Forwarder",
    "ForwarderStats",
    "open_tap",
    "start_delay_link",
    "validate_delay_ms",
]

MAX_DELAY_MS = 10_000.0  # one way; more is no WAN any more
MAX_QUEUE_BYTES = 64 << 20  # per direction; tbf in front keeps it at rate x delay in practice
READ_SIZE = 65_536 + 1_024  # a 64 KB GSO frame, its Ethernet header and the virtio-net header
READ_BATCH = 512  # frames read from one TAP per look (its queue holds 1000) before the other side gets its turn
READY_TIMEOUT_S = 15.0
SLACK_MS = 0.5  # a wakeup also releases the frames due this much later: fewer wakeups, as precise on average
PARENT_CHECK_S = 1.0  # how often an idle forwarder looks whether the process that started it is still there
TICK_MS = 1.0  # while frames are in flight, look for new ones at most this often
_BLOCKED_S = 50e-6  # a select that took longer than this waited for its frame: stamp it exactly
RT_PRIORITY = 10  # SCHED_RR priority of a forwarder: low among real-time tasks, above every normal one

# linux/if_tun.h
_TUNSETIFF = 0x400454CA
_TUNSETOFFLOAD = 0x400454D0
_IFF_TAP = 0x0002
_IFF_NO_PI = 0x1000
_IFF_VNET_HDR = 0x4000
_TUN_F_CSUM = 0x01
_TUN_F_TSO4 = 0x02
_TUN_F_TSO6 = 0x04
_TUN_F_TSO_ECN = 0x08
_IFREQ = struct.Struct("16sH22x")  # struct ifreq: name, then ifr_flags in the 24-byte union
_TUN_PATH = "/dev/net/tun"


def validate_delay_ms(value: object, what: str = "delay_ms") -> float:
    """A one-way delay in milliseconds as a float; ValueError unless finite and in [0, MAX_DELAY_MS]."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"invalid {what} {value!r}: expected a number of milliseconds")
    ms = float(value)
    if not math.isfinite(ms):
        raise ValueError(f"invalid {what} {value!r}: must be finite")
    if ms < 0:
        raise ValueError(f"invalid {what} {value!r}: must not be negative")
    if ms > MAX_DELAY_MS:
        raise ValueError(f"invalid {what} {value!r}: at most {MAX_DELAY_MS:g} ms one way")
    return ms


# --------------------------------------------------------------------------- the pure parts


class DelayQueue:
    """Frames in arrival order, each due ``delay_s`` after it was pushed.

    Release times never go backwards (a frame is never due before the one pushed ahead of it),
    so popping in FIFO order is popping in release order. A push that would take the queue over
    ``max_bytes`` is refused (a tail drop, counted in ``dropped``).
    """

    def __init__(self, delay_s: float, max_bytes: int = MAX_QUEUE_BYTES) -> None:
        if not math.isfinite(delay_s) or delay_s < 0:
            raise ValueError(f"invalid delay {delay_s!r} s: must be finite and not negative")
        if max_bytes <= 0:
            raise ValueError(f"invalid max_bytes {max_bytes!r}: must be positive")
        self.delay_s = delay_s
        self.max_bytes = max_bytes
        self.queued_bytes = 0
        self.dropped = 0
        self._q: collections.deque[tuple[float, bytes]] = collections.deque()
        self._last_release = -math.inf

    def __len__(self) -> int:
        return len(self._q)

    def push(self, frame: bytes, now: float) -> bool:
        """Queue ``frame`` received at ``now``; False when it was dropped because the queue is full."""
        if self.queued_bytes + len(frame) > self.max_bytes:
            self.dropped += 1
            return False
        release = max(now + self.delay_s, self._last_release)
        self._last_release = release
        self._q.append((release, frame))
        self.queued_bytes += len(frame)
        return True

    def next_release(self) -> float | None:
        """When the oldest frame is due, None when the queue is empty."""
        return self._q[0][0] if self._q else None

    def pop_due(self, now: float) -> list[bytes]:
        """Every frame due at ``now``, oldest first."""
        out: list[bytes] = []
        q = self._q
        while q and q[0][0] <= now:
            frame = q.popleft()[1]
            self.queued_bytes -= len(frame)
            out.append(frame)
        return out


@dataclass
class ForwarderStats:
    """Counters of one direction of a forwarder."""

    frames: int = 0
    bytes: int = 0
    dropped_full: int = 0
    write_errors: int = 0
    max_frame: int = 0
    max_late_s: float = 0.0  # the longest a frame waited past its release time (scheduling)

    def line(self) -> str:
        return (
            f"{self.frames} frames, {self.bytes} bytes, largest {self.max_frame}, "
            f"{self.dropped_full} dropped (queue full), {self.write_errors} write errors, "
            f"at most {self.max_late_s * 1e3:.1f} ms late"
        )


@dataclass
class Forwarder:
    """Copies frames between two non-blocking descriptors, each released ``delay_s`` after it arrived.

    One FIFO per direction; a single thread on ``select``. Each read is one frame (TAP devices
    and SOCK_SEQPACKET sockets keep frame boundaries). Write errors (a TAP that is down answers
    EIO) drop the frame, as a cable would; end of file on either side stops ``run``.
    """

    fd_a: int
    fd_b: int
    delay_s: float
    max_queue_bytes: int = MAX_QUEUE_BYTES
    slack_s: float = SLACK_MS / 1e3
    tick_s: float = TICK_MS / 1e3
    a_to_b: ForwarderStats = field(default_factory=ForwarderStats)
    b_to_a: ForwarderStats = field(default_factory=ForwarderStats)

    def __post_init__(self) -> None:
        for what, value in (("slack_s", self.slack_s), ("tick_s", self.tick_s)):
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"invalid {what} {value!r}: must be finite and not negative")
        self._a = _Direction(self.fd_a, self.fd_b, DelayQueue(self.delay_s, self.max_queue_bytes), self.a_to_b)
        self._b = _Direction(self.fd_b, self.fd_a, DelayQueue(self.delay_s, self.max_queue_bytes), self.b_to_a)
        self._eof = False
        self._looked = time.monotonic()  # when the loop last looked at the descriptors

    def run(self, deadline: float | None = None) -> None:
        """Forward until end of file on a side or until ``deadline`` (a ``time.monotonic()``), if given.

        Idle, it waits for the first frame and stamps it exactly. While frames are in flight it
        looks at the descriptors at most once per ``tick_s`` (sleeping in between unless a frame
        is due), so the wakeups per second stay bounded however many frames pass: the cost of a
        Python wakeup, not of a frame, dominates. Frames read after such a blind spell are stamped
        with its midpoint, so each is early or late by at most half a tick.
        """
        # the hot loop of the simulator: a few microseconds per frame matter, hence the locals
        fds = [self.fd_a, self.fd_b]
        for fd in fds:
            os.set_blocking(fd, False)
        by_fd = {self.fd_a: self._a, self.fd_b: self._b}
        both = (self._a, self._b)
        qa, qb = self._a.queue, self._b.queue
        clock, slack, tick, wait, sleep = time.monotonic, self.slack_s, self.tick_s, select.select, time.sleep
        blind = False  # slept without looking at the descriptors since the last look
        while not self._eof:
            now = clock()
            wake = deadline
            for d in both:
                head = d.queue.next_release()
                if head is not None and head <= now + slack:
                    self._release(d, now, now + slack)
                    head = d.queue.next_release()
                if head is not None and (wake is None or head < wake):
                    wake = head
            if deadline is not None and now >= deadline:
                break
            busy = bool(qa) or bool(qb)
            if busy and now < self._looked + tick:  # not yet: sleep, blind to arrivals, until a release or the tick
                sleep(max(0.0, min(self._looked + tick, wake if wake is not None else math.inf) - now))
                blind = True
                continue
            # select, not epoll: its timeout has microseconds where epoll_wait rounds up to a millisecond
            readable = wait(fds, [], [], None if wake is None else max(0.0, wake - now))[0]
            looked, self._looked = self._looked, clock()
            # a select that waited saw its frame arrive; one that did not finds frames that came
            # while we slept (stamped with the middle of that spell) or while we were busy (now)
            stamp = (looked + self._looked) / 2 if blind and self._looked - now <= _BLOCKED_S else self._looked
            blind = False
            for fd in readable:
                self._drain(by_fd[fd], stamp)

    def _drain(self, d: _Direction, now: float) -> None:
        queue, stats, fd = d.queue, d.stats, d.in_fd
        for _ in range(READ_BATCH):
            try:
                frame = os.read(fd, READ_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EBADFD: the TAP went away under us
                log.warning("read from fd %s: %s", fd, e)
                self._eof = True
                return
            if not frame:
                self._eof = True
                return
            if queue.push(frame, now):
                stats.frames += 1
                stats.bytes += len(frame)
                if len(frame) > stats.max_frame:
                    stats.max_frame = len(frame)
            else:
                stats.dropped_full += 1

    def _release(self, d: _Direction, now: float, horizon: float) -> None:
        stats, fd = d.stats, d.out_fd
        head = d.queue.next_release()
        if head is not None and now - head > stats.max_late_s:
            stats.max_late_s = now - head
        for frame in d.queue.pop_due(horizon):
            try:
                os.write(fd, frame)
            except OSError as e:  # EIO (TAP down), ENOBUFS, EAGAIN: the frame is lost
                stats.write_errors += 1
                if stats.write_errors == 1 or e.errno not in (errno.EIO, errno.EAGAIN, errno.ENOBUFS):
                    log.debug("write to fd %s: %s", fd, e)


@dataclass
class _Direction:
    in_fd: int
    out_fd: int
    queue: DelayQueue
    stats: ForwarderStats


# --------------------------------------------------------------------------- TAP devices


def open_tap(name: str, fd: int | None = None) -> int:
    """A TAP device ``name`` with a virtio-net header and TSO/checksum offloads, as a descriptor.

    The device is created in the network namespace ``fd`` (an open ``/dev/net/tun``) was
    opened in; without ``fd``, in the caller's. It exists while the descriptor is open.
    """
    if fd is None:
        fd = os.open(_TUN_PATH, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, _TUNSETIFF, _IFREQ.pack(name.encode(), _IFF_TAP | _IFF_NO_PI | _IFF_VNET_HDR))
        fcntl.ioctl(fd, _TUNSETOFFLOAD, _TUN_F_CSUM | _TUN_F_TSO4 | _TUN_F_TSO6 | _TUN_F_TSO_ECN)
    except OSError:
        os.close(fd)
        raise
    return fd


# --------------------------------------------------------------------------- the parent's side


@dataclass
class DelayLink:
    """A running forwarder process (see ``start_delay_link``)."""

    host_tap: str
    bridge_tap: str
    netns: str
    delay_ms: float
    proc: subprocess.Popen[str]

    def cpu_seconds(self) -> float:
        """User + system CPU time the forwarder has used so far (0.0 once it is gone)."""
        return process_cpu_seconds(self.proc.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, grace_s: float = 3.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s``; reaps it. Its TAPs go with it. Never raises."""
        proc = self.proc
        try:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    log.warning("delay link %s did not stop on SIGTERM: killing it", self.host_tap)
                    proc.kill()
                    proc.wait(timeout=5.0)
        except (OSError, subprocess.TimeoutExpired) as e:
            log.warning("stopping delay link %s: %s", self.host_tap, e)
        finally:
            if proc.stdout is not None:
                proc.stdout.close()


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` from /proc/<pid>/stat, in seconds; 0.0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": fields 3.. of proc(5)
    ticks = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def start_delay_link(
    *,
    netns: str,
    host_tap: str,
    bridge_tap: str,
    delay_ms: float,
    ip: str = "ip",
    python: str = sys.executable,
    rt_priority: int = RT_PRIORITY,
    slack_ms: float = SLACK_MS,
    tick_ms: float = TICK_MS,
    verbose: bool = False,
    ready_timeout_s: float = READY_TIMEOUT_S,
) -> DelayLink:
    """Start a forwarder in ``netns`` with TAP ``host_tap`` there and TAP ``bridge_tap`` here.

    Returns once both TAPs exist (still down, no address, no qdisc: the caller configures them).
    The forwarder runs at SCHED_RR ``rt_priority`` (0: as a normal process; see the module
    docstring for why). Raises RuntimeError when it could not start.
    """
    delay_ms = validate_delay_ms(delay_ms)
    for what, value in (("slack_ms", slack_ms), ("tick_ms", tick_ms)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"invalid {what} {value!r}: must be finite and not negative")
    tun = os.open(_TUN_PATH, os.O_RDWR)  # opened here: the bridge-side TAP is created in this namespace
    argv = [
        ip, "netns", "exec", netns, python, os.path.abspath(__file__),
        "--host-tap", host_tap, "--bridge-tap", bridge_tap, "--bridge-fd", str(tun), "--delay-ms", repr(delay_ms),
    ]  # fmt: skip
    argv += ["--slack-ms", repr(float(slack_ms)), "--tick-ms", repr(float(tick_ms))]
    if rt_priority:
        argv += ["--rt-priority", str(rt_priority)]
    if verbose:
        argv.append("--verbose")
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, pass_fds=[tun], start_new_session=True)
    finally:
        os.close(tun)
    link = DelayLink(host_tap=host_tap, bridge_tap=bridge_tap, netns=netns, delay_ms=delay_ms, proc=proc)
    line = _read_line(proc, ready_timeout_s)
    if line != "ready":
        link.stop(grace_s=1.0)
        why = (
            line[len("error ") :] if line.startswith("error ") else f"no handshake (got {line!r}, rc {proc.returncode})"
        )
        raise RuntimeError(f"delay link {host_tap} in {netns} did not start: {why}")
    log.debug("delay link %s <-> %s (%s): %g ms, pid %s", host_tap, bridge_tap, netns, delay_ms, proc.pid)
    return link


def _read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    if not ready:
        return f"timed out after {timeout_s:g} s"
    return proc.stdout.readline().strip()


# --------------------------------------------------------------------------- the forwarder process


def _on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host-tap", required=True, help="TAP to create in this namespace")
    parser.add_argument("--bridge-tap", required=True, help="TAP to create on --bridge-fd")
    parser.add_argument("--bridge-fd", type=int, required=True, help="an open /dev/net/tun of the bridge's namespace")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way delay, each direction")
    parser.add_argument("--slack-ms", type=float, default=SLACK_MS, help="release frames up to this much early")
    parser.add_argument("--tick-ms", type=float, default=TICK_MS, help="while busy, read at most this often")
    parser.add_argument("--rt-priority", type=int, default=0, help="SCHED_RR at this priority (1-99); 0: keep")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING,
        format=f"%(levelname)s delay_link[{args.host_tap}]: %(message)s",
    )
    signal.signal(signal.SIGTERM, _on_sigterm)
    if args.rt_priority:
        try:
            os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(args.rt_priority))
        except OSError as e:  # e.g. a cgroup without real-time runtime: run, just with more jitter
            log.warning(
                "cannot run at real-time priority %s (%s): delays will jitter on a busy machine", args.rt_priority, e
            )
    try:
        delay_s = validate_delay_ms(args.delay_ms) / 1e3
        bridge_fd = open_tap(args.bridge_tap, args.bridge_fd)
        host_fd = open_tap(args.host_tap)
        fwd = Forwarder(host_fd, bridge_fd, delay_s, slack_s=args.slack_ms / 1e3, tick_s=args.tick_ms / 1e3)
    except (OSError, ValueError) as e:
        print(f"error {e}", flush=True)
        return 1
    print("ready", flush=True)
    parent = os.getppid()
    try:
        while os.getppid() == parent:  # an orphan (the simulator was killed) stops within a second
            fwd.run(deadline=time.monotonic() + PARENT_CHECK_S)
    except KeyboardInterrupt:
        pass
    finally:
        log.info("host -> bridge: %s", fwd.a_to_b.line())
        log.info("bridge -> host: %s", fwd.b_to_a.line())
    return 0


if __name__ == "__main__":
    sys.exit(main())
