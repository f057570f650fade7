"""The ``swarmtrain`` command as a user types it (the installed console script)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import pytest

from tests.e2e.cli import EXE, REPO, no_traceback, sw
from tests.ports import free_port


def test_help_lists_the_role_commands() -> None:
    proc = sw("--help")
    assert proc.returncode == 0
    for command in ["peer", "coordinator", "status", "admin", "demo", "keygen", "spec", "doctor", "data", "export"]:
        assert f"    {command}" in proc.stdout


@pytest.mark.parametrize(
    "command", ["peer", "coordinator", "status", "admin", "demo", "keygen", "spec", "doctor", "data", "export"]
)
def test_every_command_has_help(command: str) -> None:
    proc = sw(command, "--help")
    assert proc.returncode == 0 and "usage: swarmtrain" in proc.stdout


def test_keygen_writes_a_private_key_and_prints_the_id(tmp_path: Path) -> None:
    key = tmp_path / "me.key"
    proc = sw("keygen", "--out", str(key))
    assert proc.returncode == 0, proc.stderr
    public_id = proc.stdout.splitlines()[0]
    assert public_id.startswith("ed25519:")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    again = sw("keygen", "--out", str(key))
    assert again.returncode == 1 and "already exists" in again.stderr
    no_traceback(again)


def test_keygen_default_location(tmp_path: Path) -> None:
    proc = sw("keygen", env={"SWARMTRAIN_HOME": str(tmp_path)})
    assert proc.returncode == 0 and (tmp_path / "identity.key").exists()


def test_spec_check_prints_the_digest() -> None:
    proc = sw("spec", "check", "examples/demo.toml")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("examples/demo.toml: ok sha256:")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (
            '[run]\nname = "x"\n[rounds]\ninner_steps = "ten"\n',
            "line 4: rounds.inner_steps: Input should be a valid integer",
        ),
        ('[run]\nname = "x"\n[rounds]\ninner_stepz = 5\n', "line 4: rounds.inner_stepz: unknown key"),
        ('[run]\nname = "x"\n[rounds\n', "TOML syntax error"),
    ],
    ids=["wrong-type", "unknown-key", "broken-toml"],
)
def test_spec_check_bad_input_is_one_clear_line(tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    proc = sw("spec", "check", str(path))
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and str(path) in lines[0], proc.stderr
    no_traceback(proc)


def test_spec_check_missing_file() -> None:
    proc = sw("spec", "check", "does/not/exist.toml")
    assert proc.returncode == 1 and "does/not/exist.toml: no such file" in proc.stderr
    no_traceback(proc)


def test_bad_flag_is_one_line() -> None:
    proc = sw("keygen", "--bogus")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "--bogus" in proc.stderr


def test_unsafe_key_file_is_refused_by_doctor(tmp_path: Path) -> None:
    key = tmp_path / "me.key"
    assert sw("keygen", "--out", str(key)).returncode == 0
    key.chmod(0o644)
    proc = sw("doctor", "--skip-network", "--key", str(key))
    assert proc.returncode == 1 and "chmod 600" in proc.stdout
    no_traceback(proc)


def test_status_of_an_unreachable_coordinator_is_one_clear_line() -> None:
    """It waits --timeout seconds for the coordinator to come up (a script may start it just
    before), then says so in one line."""
    proc = sw("status", "--coordinator", "127.0.0.1:1", "--timeout", "2")
    assert proc.returncode == 1
    assert "coordinator 127.0.0.1:1: no answer within 2 s (is it running" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    no_traceback(proc)


def test_coordinator_with_a_bad_spec_is_one_clear_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[run]\nname = 'x'\n[outer]\nlr = 'fast'\n")
    proc = sw("coordinator", "--spec", str(bad), "--state-dir", str(tmp_path / "state"))
    assert proc.returncode == 1 and "outer.lr" in proc.stderr
    no_traceback(proc)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--wait-for-group", "-1"], "--wait-for-group must be between 0 and 86400"),
        (["--wait-for-group", "nan"], "--wait-for-group must be between 0 and 86400"),
        (["--checkpoint-every", "0"], "--checkpoint-every must be >= 1"),
        (["--nproc-per-node", "0"], "--nproc-per-node must be in 1..64"),
        (["--micro-batches", "0"], "--micro-batches must be in 1..1024"),
        (["--port", "4000", "--announce", "1.2.3.4"], "--announce must be HOST:PORT"),
        (["--port", "4000", "--announce", "1.2.3.4:70000"], "--announce: port must be 1-65535"),
        (["--port", "4000", "--announce", "0.0.0.0:4000"], "--announce: 0.0.0.0 cannot be dialled"),
        (["--announce", "1.2.3.4:40123"], "--announce needs --port"),
        (["--port", "4000", "--announce", "1.2.3.4:4000", "--client-mode"], "a --client-mode peer is never dialled"),
        (["--relay-ports", "7801"], "--relay-ports must be FIRST-LAST"),
        (["--relay-ports", "7801-7801"], "--relay-ports needs a control port and at least one port to grant"),
        (["--port", "4000", "--relay-ports", "3999-4008"], "--relay-ports 3999-4008 includes --port 4000"),
    ],
    ids=[
        "negative-wait",
        "nan-wait",
        "zero-checkpoint-every",
        "zero-ranks",
        "zero-micro-batches",
        "announce-no-port",
        "announce-port-range",
        "announce-unspecified",
        "announce-without-port",
        "announce-client-mode",
        "relay-ports-one",
        "relay-ports-nothing-to-grant",
        "relay-ports-include-port",
    ],  # fmt: skip
)
def test_peer_bad_flags_are_one_clear_line(tmp_path: Path, flags: list[str], needle: str) -> None:
    proc = sw("peer", "--spec", "examples/demo.toml", "--key", str(tmp_path / "k.key"), *flags)
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr
    assert not (tmp_path / "k.key").exists()  # refused before anything was written
    no_traceback(proc)


@pytest.mark.parametrize(
    ("spec", "flags", "needle"),
    [
        ("examples/llama-tiny.toml", ["--micro-batches", "3"], "micro-batches 3 must divide the run's inner.batch_size 8 (one of 1, 2, 4, 8)"),
        ("examples/demo.toml", ["--activation-checkpointing", "on"], "are the causal_lm task's; this run's task is 'bytegpt'"),
    ],
    ids=["not-a-divisor", "not-a-causal-lm-run"],
)  # fmt: skip
def test_peer_compute_flags_the_run_cannot_take_are_one_clear_line(
    tmp_path: Path, spec: str, flags: list[str], needle: str
) -> None:
    """A peer's own micro-batches/checkpointing are checked against the run before anything
    starts (the data, the swarm)."""
    proc = sw("peer", "--spec", spec, "--key", str(tmp_path / "k.key"), *flags)
    assert proc.returncode != 0
    assert needle in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    no_traceback(proc)


@pytest.mark.parametrize("role", ["peer", "coordinator"])
def test_a_tmpdir_too_long_for_torchs_socket_is_one_clear_line(tmp_path: Path, role: str) -> None:
    """Under a TMPDIR longer than 73 bytes torch's shared-memory manager cannot start (its Unix
    socket path would pass 107 bytes): refused in one line before anything starts, instead of a
    traceback from inside hivemind."""
    long_tmp = tmp_path / ("t" * 80)  # need not exist: refused before it is used
    key = tmp_path / "k.key"
    args = ["--spec", "examples/demo.toml"]
    args += ["--key", str(key)] if role == "peer" else ["--state-dir", str(tmp_path / "state")]
    proc = sw(role, *args, env={"TMPDIR": str(long_tmp)})
    assert proc.returncode != 0
    assert "TMPDIR is" in proc.stderr and "107-byte limit of a Unix socket path" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not key.exists() and not (tmp_path / "state").exists()
    no_traceback(proc)


def test_export_writes_a_model_directory_or_says_in_one_line_why_not(tmp_path: Path) -> None:
    """A demo peer's checkpoint (the byte model) exported as a user does it; a missing source, a
    used output directory and a file that is no checkpoint each get one line and write nothing."""
    import torch

    from engine.checkpoint import Checkpointer
    from peer.round.state import flatten
    from peer.task.bytegpt import build_model
    from protocol.spec import load_spec

    spec = load_spec(REPO / "swarmtrain" / "demo.toml")
    params = flatten(build_model(spec.task.model, seed=1))
    saver = Checkpointer(tmp_path / "ckpt", spec_digest=spec.digest(), spec=spec)
    saver.save({"round": 9, "params": params, "momentum": torch.zeros_like(params)})
    done = sw("export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "model"))
    assert done.returncode == 0, done.stderr
    assert f"exported round 9 of {spec.run.name} ({params.numel():,} parameters, gpt2)" in done.stdout
    assert {"config.json", "model.safetensors", "tokenizer.json", "swarmtrain.json"} <= {
        p.name for p in (tmp_path / "model").iterdir()
    }
    (tmp_path / "junk.pt").write_bytes(b"junk")
    for args, needle in (
        ([str(tmp_path / "nowhere"), "--out", str(tmp_path / "m1")], "nowhere: no such file or directory"),
        ([str(tmp_path / "ckpt"), "--out", str(tmp_path / "model")], "not an empty directory"),
        ([str(tmp_path / "junk.pt"), "--out", str(tmp_path / "m2")], "junk.pt: not a readable checkpoint"),
        ([str(tmp_path / "ckpt")], "the following arguments are required: --out"),
    ):
        refused = sw("export", *args)
        assert refused.returncode != 0 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
        assert needle in refused.stderr, refused.stderr
        no_traceback(refused)
    assert not (tmp_path / "m1").exists() and not (tmp_path / "m2").exists()


def test_a_second_coordinator_on_a_taken_port_is_refused_in_one_line(tmp_path: Path) -> None:
    """gRPC's default SO_REUSEPORT let a second coordinator share the first one's port silently
    (the kernel split the peers between them): now each port is checked before anything starts."""
    from swarmtrain.localswarm import LocalCoordinator

    spec = REPO / "swarmtrain" / "demo.toml"
    grpc_port, http_port = free_port(), free_port()
    first = LocalCoordinator(spec, tmp_path / "first", grpc_port=grpc_port, http_port=http_port, host="127.0.0.1")
    try:
        assert first.address().endswith(f":{grpc_port}")
        for flag, flags, taken in (
            ("--grpc-port", ["--grpc-port", str(grpc_port), "--http-port", "0"], grpc_port),
            ("--http-port", ["--grpc-port", "0", "--http-port", str(http_port)], http_port),
        ):
            second = sw("coordinator", "--spec", str(spec), "--state-dir", str(tmp_path / "second"),
                        "--host", "127.0.0.1", "--relay-port", "0", "--archive-every", "0", *flags)  # fmt: skip
            assert second.returncode == 1, second.stdout + second.stderr
            lines = second.stderr.strip().splitlines()
            assert len(lines) == 1 and f"cannot listen on 127.0.0.1:{taken}" in lines[0], second.stderr
            assert "another coordinator may be running there" in lines[0] and f"another {flag}" in lines[0]
            no_traceback(second)
    finally:
        first.stop()


@pytest.mark.parametrize("command", [["status"], ["admin", "list"], ["peer"], ["doctor"]])
def test_a_coordinator_address_without_a_port_is_refused_at_once(command: list[str]) -> None:
    import time

    started = time.monotonic()
    proc = sw(*command, "--coordinator", "localhost")
    assert proc.returncode == 2 and time.monotonic() - started < 30  # not the 10 s dial of a bad address
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "'localhost' has no port: give HOST:PORT" in lines[0] and "localhost:7500" in lines[0]
    no_traceback(proc)


def test_a_misspelt_flag_gets_the_flag_it_was_meant_to_be() -> None:
    for args, meant in (
        (["peer", "--coordinatr", "h:1"], "--coordinator"),
        (["coordinator", "--spec", "x.toml", "--http-prt", "1"], "--http-port"),
        (["status", "--coordinator", "h:1", "--jsn"], "--json"),
    ):
        proc = sw(*args)
        assert proc.returncode == 2 and f"(did you mean {meant}?)" in proc.stderr, proc.stderr
        assert f"see `swarmtrain {args[0]} --help`" in proc.stderr
        no_traceback(proc)


def test_the_help_texts_say_what_the_flags_do_and_their_defaults() -> None:
    peer = sw("peer", "--help").stdout
    assert "issue #" not in peer and "(behind NAT)" not in peer
    assert "a peer behind NAT needs no flag" in " ".join(peer.split())
    assert "With --coordinator it joins" in " ".join(peer.split())
    options = " ".join(sw("coordinator", "--help").stdout.split("options:", 1)[1].split())
    for flag, default in (("--state-dir", "./coordinator-state"), ("--host", "0.0.0.0"), ("--grpc-port", "7500"),
                          ("--http-port", "8080"), ("--relay-port", "7800"), ("--dht-port", "0")):  # fmt: skip
        described = re.search(rf"{flag} [A-Z_]+ (.*?)(?= --[a-z]|$)", options)
        assert described and f"default: {default}" in described.group(1), (flag, described and described.group(1))


def test_the_doctor_checks_the_port_the_peer_would_take() -> None:
    """`doctor --port` defaulted to 31337 where `peer --port` takes any free port: the same now."""
    from swarmtrain.cli import build_parser

    parser = build_parser()
    peer = parser.parse_args(["peer", "--coordinator", "h:1"])
    doctor = parser.parse_args(["doctor"])
    assert doctor.port == peer.port == 0


def test_a_peer_whose_coordinator_is_not_there_says_so_in_words(tmp_path: Path) -> None:
    """It printed gRPC's own details ("failed to connect to all addresses; last error: UNKNOWN:
    ipv4:..."); now what they mean and what to check, and it keeps waiting for the coordinator."""
    import threading

    from swarmtrain.localswarm import wait_until

    port = free_port()  # nothing listens there
    proc = subprocess.Popen(
        [EXE, "peer", "--coordinator", f"127.0.0.1:{port}", "--key", str(tmp_path / "k")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
        env={**os.environ, "SWARMTRAIN_HOME": str(tmp_path)},
    )  # fmt: skip
    lines: list[str] = []

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)

    threading.Thread(target=read, daemon=True).start()
    try:
        wait_until(lambda: any("is not answering" in line for line in lines), 60, "the peer's waiting line")
        said = next(line for line in lines if "is not answering" in line)
        assert "connection refused: nothing listens there" in said and "failed to connect" not in said, said
        assert proc.poll() is None  # still waiting for its coordinator
    finally:
        proc.terminate()  # a supervisor's stop: it waited on for the coordinator, deaf to it
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()  # reaped either way (by pid)
            proc.wait()
            raise
    assert code == 0 and any("stopped before the coordinator answered" in line for line in lines), lines
    assert "Traceback" not in "".join(lines)


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_a_coordinator_stops_within_seconds_and_quietly(tmp_path: Path, how: str) -> None:
    """A supervisor's SIGTERM, or a Ctrl-C at its terminal (SIGINT to its whole process group,
    the archive averager included): it stops in seconds, says so, and prints no traceback (it
    took 144 s once, printed a 30-line traceback another time, and logged "Averager shutdown has
    no effect" at every stop)."""
    import signal
    import time

    from swarmtrain.localswarm import LocalCoordinator, wait_until

    coordinator = LocalCoordinator(REPO / "swarmtrain" / "demo.toml", tmp_path / "state", host="127.0.0.1")
    try:
        coordinator.address()
        wait_until(lambda: any(line.startswith("peers join with:") for line in coordinator.lines), 60, "its banner")
        started = time.monotonic()
        if how == "sigterm":
            coordinator.proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(coordinator.proc.pid, signal.SIGINT)  # its own group (start_new_session)
        code = coordinator.proc.wait(timeout=60)
        took = time.monotonic() - started
        wait_until(lambda: not coordinator._reader.is_alive(), 10, "its output to end")
    finally:
        coordinator.kill()
    said = "\n".join(coordinator.lines)
    assert code == 0 and took < 20, (code, took, said[-2000:])
    assert "coordinator stopped" in said and "Traceback" not in said, said[-3000:]
    assert "Averager shutdown has no effect" not in said, said[-3000:]


def test_the_doctor_prints_what_one_peer_needs_from_the_spec_alone() -> None:
    proc = sw("doctor", "--requirements", "--spec", str(REPO / "examples" / "llama-1b.toml"), "--round-s", "300")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("one peer of llama-1b"), proc.stdout
    for line in (
        "model         1,235,814,400 parameters",
        "GPU memory    26.3 GiB per GPU",
        "per day at one round every 300 s",
    ):
        assert line in proc.stdout, proc.stdout
    as_json = sw("doctor", "--requirements", "--spec", str(REPO / "examples" / "demo.toml"), "--json")
    assert as_json.returncode == 0 and '"up_bytes_per_day"' in as_json.stdout, as_json.stdout
    for flags, needle in (
        ([], "--requirements needs the run's spec: --spec FILE or --coordinator HOST:PORT"),
        (["--spec", str(REPO / "examples" / "demo.toml"), "--round-s", "-5"], "a round lasts a positive number"),
    ):
        bad = sw("doctor", "--requirements", *flags)
        assert bad.returncode != 0 and needle in bad.stderr and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        no_traceback(bad)


def test_a_silent_command_prints_its_stacks_on_sigusr1_and_goes_on(tmp_path: Path) -> None:
    """A child that stays silent past a test's deadline is asked for its threads' stacks, so a
    failure names the line it waits on; the signal leaves it running."""
    from swarmtrain.localswarm import LocalPeer

    port = free_port()  # nothing listens there: the peer waits in its join, saying so once
    peer = LocalPeer(["--coordinator", f"127.0.0.1:{port}", "--key", str(tmp_path / "k")], tmp_path, "waiting")
    try:
        peer.printed(r"^(coordinator \S+) is not answering", 60)
        with pytest.raises(RuntimeError) as failed:
            peer.printed(r"^a line it never prints$", 1)
        said = str(failed.value)
        assert "still running" in said and "its threads' stacks (SIGUSR1)" in said, said
        assert "join_when_up" in said and "most recent call first" in said, said
        assert peer.proc.poll() is None
    finally:
        peer.terminate(grace_s=30)
