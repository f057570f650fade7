"""`swarmtrain doctor` as a volunteer types it: it passes against a real local coordinator,
and each failure it must catch gives one actionable FAIL line and exit status 1."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from protocol.identity import Identity
from swarmtrain.localswarm import Child, LocalCoordinator, swarmtrain_executable
from tests.e2e.cli import no_traceback, sw

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "examples" / "demo.toml"
TINY = REPO / "examples" / "llama-tiny.toml"
HUGE = """
[run]
name = "seventy-b"
[task]
kind = "causal_lm"
[task.causal_lm]
architecture = "llama"
seq_len = 4096
[task.causal_lm.config]
vocab_size = 128256
hidden_size = 8192
intermediate_size = 28672
num_hidden_layers = 80
num_attention_heads = 64
num_key_value_heads = 8
[data]
source = "tokens"
path = "data"
manifest = "sha256:{zeros}"
tokenizer = "sha256:{zeros}"
[inner]
batch_size = 1
"""


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc = LocalCoordinator(DEMO, tmp_path_factory.mktemp("doctor") / "state", host="127.0.0.1")
    try:
        yield proc.address()
    finally:
        proc.stop()


def lines(proc: subprocess.CompletedProcess[str], status: str) -> dict[str, str]:
    """Check name -> its line, for the lines of ``status`` (ok, warn, FAIL, skip)."""
    found = {}
    for line in proc.stdout.splitlines():
        label, _, rest = line.partition("  ")
        if label.strip() == status.strip():
            found[rest.split(":", 1)[0].strip()] = line
    return found


def test_doctor_passes_against_a_local_coordinator(coordinator: str, tmp_path: Path) -> None:
    key = tmp_path / "identity.key"
    proc = sw("doctor", "--coordinator", coordinator, "--port", "0", "--key", str(key))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ok = lines(proc, "ok")
    for check in (
        "coordinator",
        "version",
        "clock",
        "DHT bootstrap",
        "reachable from outside",
        "bandwidth",
        "memory",
        "joining on this downlink",
        "/dev/shm",
        "expected contribution",
    ):
        assert check in ok, proc.stdout
    assert "the coordinator reached this machine at 127.0.0.1:" in ok["reachable from outside"]
    assert "samples/hour" in ok["expected contribution"] and "the run's spec" in ok["memory"]
    assert "the state (1.1 MB) downloads in" in ok["joining on this downlink"], ok["joining on this downlink"]
    assert proc.stdout.rstrip().endswith("all checks passed")
    no_traceback(proc)


def test_doctor_json_is_one_document_for_scripts(coordinator: str, tmp_path: Path) -> None:
    proc = sw("doctor", "--coordinator", coordinator, "--port", "0", "--spec", str(DEMO), "--no-benchmark", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] is True
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["spec digest"]["status"] == "ok"
    assert checks["expected contribution"]["status"] == "skip"
    assert checks["bandwidth"]["data"]["upload_bits_per_s"] > 0
    assert checks["memory"]["data"]["params"] == 136_960
    assert checks["joining on this downlink"]["data"]["state_download_s"] > 0


def test_unreachable_coordinator_is_one_fail_line_with_the_fix() -> None:
    proc = sw("doctor", "--coordinator", "127.0.0.1:1", "--no-benchmark")
    assert proc.returncode == 1
    fail = lines(proc, "FAIL")
    assert list(fail) == ["coordinator"], proc.stdout
    assert (
        "coordinator 127.0.0.1:1 unreachable" in fail["coordinator"]
        and "-> fix: check HOST:PORT" in fail["coordinator"]
    )
    assert {"version", "clock", "bandwidth"} <= set(lines(proc, "skip"))
    no_traceback(proc)


def test_spec_digest_mismatch_is_one_fail_line_with_the_fix(coordinator: str) -> None:
    proc = sw("doctor", "--coordinator", coordinator, "--port", "0", "--spec", str(TINY), "--no-benchmark")
    assert proc.returncode == 1
    fail = lines(proc, "FAIL")
    assert list(fail) == ["spec digest"], proc.stdout
    assert "spec digest mismatch" in fail["spec digest"] and "use the run's spec" in fail["spec digest"]
    no_traceback(proc)


def test_a_model_too_large_for_this_machine_is_one_fail_line(tmp_path: Path) -> None:
    spec = tmp_path / "70b.toml"
    spec.write_text(HUGE.format(zeros="0" * 64))
    proc = sw("doctor", "--spec", str(spec), "--skip-network")
    assert proc.returncode == 1
    fail = lines(proc, "FAIL")
    assert "not enough memory for this model (70,553,706,496 parameters)" in fail["memory"], proc.stdout
    assert "-> fix:" in fail["memory"]
    assert "does not fit" in lines(proc, "skip")["expected contribution"]
    no_traceback(proc)


def test_a_small_dev_shm_is_one_fail_line_naming_the_docker_flag(tmp_path: Path) -> None:
    """The doctor in a mount namespace whose /dev/shm is a 1 MiB tmpfs (a container's case)."""
    unshare = shutil.which("unshare")
    probe = subprocess.run([unshare or "unshare", "-m", "true"], capture_output=True) if unshare else None
    if probe is None or probe.returncode != 0:
        pytest.skip("no mount namespaces here (needs root or user namespaces)")
    command = [*swarmtrain_executable(), "doctor", "--spec", str(TINY), "--skip-network", "--no-benchmark"]
    script = 'mount -t tmpfs -o size=1m tmpfs /dev/shm && exec "$@"'
    proc = subprocess.run(
        ["unshare", "-m", "sh", "-c", script, "sh", *command], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    fail = lines(proc, "FAIL")
    assert list(fail) == ["/dev/shm"], proc.stdout
    assert "/dev/shm has 1 MiB free, the averager needs 5 MiB" in fail["/dev/shm"]
    assert "--shm-size=" in fail["/dev/shm"]
    no_traceback(proc)


def test_a_first_peer_needs_only_the_coordinator_and_creates_its_key(coordinator: str, tmp_path: Path) -> None:
    """`swarmtrain peer --coordinator HOST:PORT` and nothing else: the account key is created
    under the per-user config directory with a message, and the peer joins the run."""
    home = tmp_path / "config"
    peer = Child(["peer", "--coordinator", coordinator], tmp_path / "peer.log", "peer", {"XDG_CONFIG_HOME": str(home)})
    try:
        key = home / "swarmtrain" / "identity.key"
        assert peer.printed(r"^created your account key at (\S+) \(mode 0600\)", 120) == str(key)
        assert key.stat().st_mode & 0o777 == 0o600
        account = peer.printed(r"^peer ed25519:\S+ of account (ed25519:\S+) \(new identity\) joining run 'demo'", 120)
        assert account == Identity.load(key).public_key.id
        peer.printed(r"^(listening): ", 60)
    finally:
        peer.kill()


def test_the_peers_compute_flags_are_checked_as_the_peer_would_use_them() -> None:
    """`--micro-batches`/`--activation-checkpointing` as `swarmtrain peer` takes them: a value
    the run cannot take is one FAIL line; a good one is what the memory line estimates."""
    proc = sw("doctor", "--spec", str(TINY), "--skip-network", "--no-benchmark", "--micro-batches", "3")
    assert proc.returncode == 1
    assert "micro-batches 3 must divide the run's inner.batch_size 8" in lines(proc, "FAIL")["memory"], proc.stdout
    assert "peer flags do not fit the run" in lines(proc, "skip")["expected contribution"]
    no_traceback(proc)
    flags = ["--micro-batches", "2", "--activation-checkpointing", "on"]
    proc = sw("doctor", "--spec", str(TINY), "--skip-network", "--no-benchmark", *flags)
    assert proc.returncode == 0, proc.stdout
    assert "with --micro-batches 2 --activation-checkpointing on" in lines(proc, "ok")["memory"], proc.stdout
    no_traceback(proc)
