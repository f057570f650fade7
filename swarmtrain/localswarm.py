"""Local `swarmtrain peer` processes on loopback: start, watch, reap (by pid, never by name).

Used by ``swarmtrain demo``, the integration tests and the local benchmarks.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from swarmtrain.lifetime import PARENT_ENV

MADDR_RE = re.compile(r"^listening: (/ip4/127\.0\.0\.1/\S+)$")


def swarmtrain_executable() -> list[str]:
    """The command that runs ``swarmtrain`` in this environment."""
    exe = shutil.which("swarmtrain", path=str(Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "swarmtrain"]


def wait_until(predicate: Callable[[], bool], deadline_s: float, what: str) -> None:
    """Poll ``predicate`` until it holds; ``TimeoutError`` naming ``what`` after ``deadline_s``.

    A predicate that fails the way a service still starting or busy makes it fail (a refused
    or timed-out connection, a command that timed out, a failed check) counts as "not yet";
    the last such error is named in the ``TimeoutError``."""
    deadline = time.monotonic() + deadline_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except (OSError, AssertionError, subprocess.SubprocessError) as exc:
            last = exc
        time.sleep(0.1)
    detail = f" (last error: {last!r})" if last is not None else ""
    raise TimeoutError(f"timed out after {deadline_s:.0f} s waiting for {what}{detail}")


def _parent_env() -> dict[str, str]:
    """Tell the child to leave when this process dies (``swarmtrain.lifetime``). Only from the
    main thread: the kernel signals the child when the *thread* that started it ends."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {PARENT_ENV: str(os.getpid())}


class Child:
    """A `swarmtrain` child in its own process group, its output kept and logged to a file."""

    def __init__(
        self,
        argv: list[str],
        log: Path,
        name: str,
        env: dict[str, str],
        cwd: Path | None = None,
        executable: list[str] | None = None,
    ) -> None:
        self.name, self.log = name, log
        self.lines: list[str] = []
        self.proc = subprocess.Popen(
            [*(executable or swarmtrain_executable()), *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **_parent_env(), **env},
            # its own process group: hivemind's DHT/averager children and p2pd die with it
            start_new_session=True,
            cwd=cwd,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.log.open("w") as out:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip("\n"))
                out.write(line)
                out.flush()

    def printed(self, pattern: str, deadline_s: float) -> str:
        """Group 1 of the first output line matching ``pattern``; raises if it exits or stays
        silent. A child still running at the deadline is asked for its threads' stacks first
        (``swarmtrain.cli.STACKS_SIGNAL``), which the error then shows: where it waits."""
        regex = re.compile(pattern)
        started = time.monotonic()
        deadline = started + deadline_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                match = regex.match(line)
                if match:
                    return match.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        state = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else "still running"
        tail = self.lines[-20:] + (self._stacks() if self.proc.poll() is None else [])
        raise RuntimeError(
            f"{self.name} printed no line like {pattern!r} in {time.monotonic() - started:.0f} s ({state}, "
            f"{len(self.lines)} lines):\n" + "\n".join(tail)
        )

    def _stacks(self, wait_s: float = 5.0) -> list[str]:
        """The stacks the running child prints on ``SIGUSR1`` (faulthandler), as output lines."""
        before = len(self.lines)
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
        except ProcessLookupError:
            return []
        deadline = time.monotonic() + wait_s
        settled_at, seen = time.monotonic(), before
        while time.monotonic() < deadline:
            if len(self.lines) != seen:
                settled_at, seen = time.monotonic(), len(self.lines)
            elif seen > before and time.monotonic() - settled_at > 0.5:
                break
            time.sleep(0.1)
        return ["--- its threads' stacks (SIGUSR1):", *self.lines[before:]]

    def kill(self) -> None:
        """SIGKILL the child and every process of the group it leads (ours, by pgid)."""
        kill_group(self.proc)

    def terminate(self, grace_s: float) -> None:
        """SIGTERM (a clean stop), up to ``grace_s`` for it to exit, then ``kill`` what is left."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


class LocalPeer(Child):
    """One `swarmtrain peer` child."""

    def __init__(
        self,
        args: list[str],
        workdir: Path,
        name: str,
        *,
        threads: int = 1,
        env: dict[str, str] | None = None,
        executable: list[str] | None = None,
    ) -> None:
        self.metrics_file = workdir / f"{name}.jsonl"
        self._asked_to_leave = False
        # one torch thread per peer: several peers share this machine's cores
        argv = ["peer", *args, "--metrics-file", str(self.metrics_file)]
        env = {"OMP_NUM_THREADS": str(threads), **(env or {})}
        super().__init__(argv, workdir / f"{name}.log", name, env, executable=executable)

    def node_id(self, deadline_s: float = 60.0) -> str:
        """The public id of the node key this peer signs with (``peer.node.node_identity``)."""
        return self.printed(r"^peer (\S+) of account ", deadline_s)

    def wait_for_maddr(self, deadline_s: float = 120.0) -> str:
        """The loopback multiaddr the peer printed."""
        return self.printed(MADDR_RE.pattern, deadline_s)

    def rounds(self) -> list[dict[str, Any]]:
        """Rows of its metrics file so far."""
        if not self.metrics_file.exists():
            return []
        rows = []
        for line in self.metrics_file.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                break  # a line being written
        return rows

    def wait(self, timeout: float) -> int:
        """Its exit code; raises ``TimeoutError`` naming it, with its last lines, if it runs
        past ``timeout`` seconds (a test's own deadline should fire before pytest-timeout's,
        so that what the peer was doing is in the report)."""
        try:
            code = self.proc.wait(timeout=max(timeout, 0.0))
        except subprocess.TimeoutExpired:
            tail = "\n".join(self.lines[-30:])
            raise TimeoutError(f"{self.name} still running after {timeout:.0f} s:\n{tail}") from None
        self._reader.join(timeout=10)
        return code

    def leave(self) -> None:
        """Ask the peer to leave after its current round (one SIGTERM; a second would mean
        "exit now"). Returns at once; ``stop`` waits."""
        if self.proc.poll() is None and not self._asked_to_leave:
            self._asked_to_leave = True
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, grace_s: float = 30.0) -> None:
        """Graceful leave (``leave``), then SIGKILL after ``grace_s``; always reaps."""
        if self.proc.poll() is None:
            self.leave()
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self._reader.join(timeout=10)


def wait_all(peers: Sequence[LocalPeer], deadline_s: float) -> list[int]:
    """The exit codes of ``peers``, all within one deadline of ``deadline_s`` seconds from now."""
    deadline = time.monotonic() + deadline_s
    return [peer.wait(timeout=deadline - time.monotonic()) for peer in peers]


def kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the process group led by ``proc`` (started with start_new_session) and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    if proc.poll() is None:
        proc.wait(timeout=30)


def start_peers(
    spec: Path,
    count: int,
    workdir: Path,
    extra: list[str] | None = None,
    *,
    coordinator: str | None = None,
    executables: dict[int, list[str]] | None = None,
    checkpoints: bool = False,
    envs: dict[int, dict[str, str]] | None = None,
) -> list[LocalPeer]:
    """Start ``count`` peers of ``spec`` on loopback: through ``coordinator`` (HOST:PORT) when
    given, else the first one bootstrapping the others. ``executables`` runs peer ``i`` with
    another command than ``swarmtrain`` (a test's wrapper around it); ``checkpoints`` gives
    peer ``i`` the checkpoint directory ``workdir/peer<i>-checkpoints``; ``envs`` adds to peer
    ``i``'s environment."""
    peers: list[LocalPeer] = []
    try:
        for i in range(count):
            source = ["--coordinator", coordinator] if coordinator else ["--spec", str(spec)]
            # default hosts (every interface), as volunteers run peers
            args = [*source, "--key", str(workdir / f"peer{i}.key")]
            args += ["--shard-seed", str(i), *(extra or [])]
            if checkpoints:
                args += ["--checkpoint-dir", str(workdir / f"peer{i}-checkpoints")]
            if peers and not coordinator:
                args += ["--initial-peers", peers[0].wait_for_maddr()]
            peers.append(
                LocalPeer(args, workdir, f"peer{i}", env=(envs or {}).get(i), executable=(executables or {}).get(i))
            )
        peers[0].wait_for_maddr()
    except BaseException:
        for peer in peers:
            peer.kill()
        raise
    return peers


class LocalCoordinator(Child):
    """A `swarmtrain coordinator` child on loopback."""

    def __init__(
        self,
        spec: Path,
        state_dir: Path,
        *,
        db_url: str | None = None,
        grpc_port: int = 0,
        http_port: int = 0,
        extra: list[str] | None = None,
        host: str | None = None,
        executable: list[str] | None = None,
    ) -> None:
        """``host`` None: the coordinator's default (every interface), as an operator runs it;
        ``executable``: how to run ``swarmtrain`` (e.g. inside a network namespace)."""
        state_dir.mkdir(parents=True, exist_ok=True)
        argv = [
            "coordinator",
            "--spec",
            str(spec),
            "--state-dir",
            str(state_dir),
            *(["--host", host] if host else []),
            "--grpc-port",
            str(grpc_port),
            "--http-port",
            str(http_port),
            "--relay-port",  # any free port: several local swarms may run at once
            "0",
            *(["--db", db_url] if db_url else []),
            *(extra or []),
        ]
        super().__init__(argv, state_dir / "coordinator.log", "coordinator", {}, executable=executable)

    def address(self, deadline_s: float = 120.0) -> str:
        """HOST:PORT of its gRPC API."""
        return self.printed(r"^grpc: (\S+)$", deadline_s)

    def http(self, deadline_s: float = 120.0) -> str:
        """Base URL of its dashboard and JSON API (ends with /)."""
        return self.printed(r"^http: (http://\S+/)", deadline_s)

    def heartbeats(self, deadline_s: float = 120.0) -> str:
        """HOST:PORT of its heartbeat processes (``coordinator.front``)."""
        return self.printed(r"^heartbeats: (\S+) ", deadline_s)

    def stop(self, grace_s: float = 15.0) -> None:
        self.terminate(grace_s)


class LocalDataServer(Child):
    """A `swarmtrain data serve` child publishing a prepared directory on loopback."""

    def __init__(
        self, directory: Path, log: Path, *, host: str = "127.0.0.1", executable: list[str] | None = None
    ) -> None:
        argv = ["data", "serve", str(directory), "--host", host, "--port", "0"]
        super().__init__(argv, log, "data-server", {}, executable=executable)

    def url(self, deadline_s: float = 60.0) -> str:
        """The base URL it serves the directory at (ends with /): a spec's ``data.url``."""
        return self.printed(r"^serving .* at (http://\S+/)$", deadline_s)

    def stop(self, grace_s: float = 10.0) -> None:
        self.terminate(grace_s)
