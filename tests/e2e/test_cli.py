"""The ``swarmtrain`` command as a user types it (the installed console script)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXE = shutil.which("swarmtrain", path=str(Path(sys.executable).parent)) or "swarmtrain"


def sw(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EXE, *args], capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, **(env or {})}
    )


def no_traceback(proc: subprocess.CompletedProcess[str]) -> None:
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout


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
    from peer.state import flatten
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
