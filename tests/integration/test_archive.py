"""The coordinator's archive with a real coordinator process and real peers: it fetches the
swarm's state every K rounds, verifies it against the finalized digests, keeps the last
few on disk, and serves them to a newcomer when no peer can (peers gone; coordinator
restarted)."""

from __future__ import annotations

import json
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from coordinator.archive import CheckpointArchive
from protocol.spec import load_spec
from swarmtrain.localswarm import LocalCoordinator, LocalPeer, start_peers, swarmtrain_executable, wait_until
from tests.integration.coordinator_status import status
from tests.specs import tiny_spec

SPEC = tiny_spec("archive")
EVERY, KEEP = 2, 2
ADOPTED = re.compile(r"adopted the swarm's state of round (\d+) \((blake3:[0-9a-f]+)")


def get(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=10) as response:
        return json.loads(response.read())


def newcomer(address: str, workdir: Path, name: str) -> tuple[LocalPeer, int, dict]:
    """A peer that joins, catches up, trains one (lonely) round and leaves."""
    peer = LocalPeer(
        [
            "--coordinator",
            address,
            "--host",
            "127.0.0.1",
            "--key",
            str(workdir / f"{name}.key"),
            "--max-rounds",
            "1",
            "--wait-for-group",
            "0",
            "-v",
        ],
        workdir,
        name,
    )
    try:
        assert peer.wait(timeout=180) == 0, "\n".join(peer.lines[-30:])
    finally:
        peer.kill()
    adopted = [m for m in map(ADOPTED.search, peer.lines) if m]
    assert adopted, "\n".join(peer.lines[-30:])
    rows = peer.rounds()
    return peer, int(adopted[-1].group(1)), rows[0]


def test_archive_keeps_verified_checkpoints_and_serves_them_when_no_peer_can(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    state = tmp_path / "state"
    extra = ["--archive-every", str(EVERY), "--archive-keep", str(KEEP)]
    coordinator = LocalCoordinator(spec, state, extra=extra)
    peers: list[LocalPeer] = []
    try:
        base = coordinator.http()
        peers = start_peers(spec, 2, tmp_path, extra=["--max-rounds", "100000"], coordinator=coordinator.address())

        def archived_twice() -> bool:
            kept = get(base, "api/v1/checkpoints")["checkpoints"]
            return len(kept) >= 2 and kept[0]["round"] >= kept[1]["round"] + EVERY

        wait_until(archived_twice, 240, "two archived checkpoints")
        for peer in peers:  # all leave at once (each finishes its round first)
            peer.leave()
        for peer in peers:
            peer.stop(grace_s=90)
            assert peer.proc.returncode == 0, "\n".join(peer.lines[-20:])

        def on_disk() -> list[str]:
            return sorted(p.name for p in (state / "archive").glob("round-*.pt"))

        # a save the archiver began before the peers left may still be landing
        def settled() -> bool:
            return sorted(c["file"] for c in get(base, "api/v1/checkpoints")["checkpoints"]) == on_disk()

        wait_until(settled, 60, "the archive listing to match the files on disk")
        listing = get(base, "api/v1/checkpoints")
        assert listing["enabled"] and listing["every_rounds"] == EVERY
        kept = listing["checkpoints"]
        assert 1 <= len(kept) <= KEEP and [c["round"] for c in kept] == sorted((c["round"] for c in kept), reverse=True)
        assert on_disk() == sorted(c["file"] for c in kept)
        latest = CheckpointArchive(state / "archive", spec_digest=load_spec(spec).digest(), keep=KEEP).load_latest()
        assert latest is not None and (latest.round, latest.state_digest) == (kept[0]["round"], kept[0]["state_digest"])
        # an archived state is one the swarm agreed on: the state the peers averaged into at that
        # round, and the finalized one if the coordinator finalized the round (it may not: when
        # one member's all-reduce failed at its end, the other's claim has no witness, and the
        # archiver confirmed the round by the peers' digest records instead)
        averaged = {
            row["state_digest"] for p in peers for row in p.rounds() if row["averaged"] and row["round"] == latest.round
        }
        assert averaged == {latest.state_digest}, averaged
        finalized = {r["round"]: r["state_digest"] for r in get(base, "api/v1/rounds")}
        assert finalized.get(latest.round, latest.state_digest) == latest.state_digest
        assert get(base, "api/v1/status")["last_checkpoint_round"] == latest.round
        terminal = status(coordinator.address())
        assert terminal["last_checkpoint_round"] == latest.round
        assert terminal["archive"] == f"every {EVERY} rounds, last {KEEP} kept"

        # model out: the coordinator exports the newest archived round and links it; anyone downloads
        # it and loads it with transformers; nothing but the export's own files is served
        wait_until(lambda: get(base, "api/v1/model")["round"] == latest.round, 180, "the archive's model export")
        model = get(base, "api/v1/model")
        assert model["state_digest"] == latest.state_digest and model["architecture"] == "gpt2", model
        downloaded = tmp_path / "downloaded-model"
        downloaded.mkdir()
        for entry in model["files"]:
            with urllib.request.urlopen(base + entry["url"], timeout=30) as response:
                (downloaded / entry["name"]).write_bytes(response.read())
            assert (downloaded / entry["name"]).stat().st_size == entry["bytes"]
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(str(downloaded))
        assert sum(p.numel() for p in loaded.parameters()) == model["parameters"] == latest.params.numel()
        for name in ("index.json", "..%2Fcoordinator.log", "swarmtrain.json.bak"):
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(base + "model/" + name, timeout=10)
            assert refused.value.code == 404
        # and by hand, from the coordinator's state directory
        done = subprocess.run([*swarmtrain_executable(), "export", str(state), "--out", str(tmp_path / "by-hand")],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0 and f"exported round {latest.round} of archive" in done.stdout, done.stderr

        # no peer left to serve the latest state: a newcomer falls back to the archive
        _, round_, row = newcomer(coordinator.address(), tmp_path, "late1")
        assert round_ == latest.round
        assert row["round"] == latest.round and not row["averaged"]  # alone: its round failed, state kept

        # the coordinator restarts: it serves the archive from disk at once
        coordinator.stop()
        coordinator = LocalCoordinator(spec, state, extra=extra)
        _, round_, row = newcomer(coordinator.address(), tmp_path, "late2")
        assert round_ == latest.round
    finally:
        for peer in peers:
            peer.kill()
        coordinator.kill()
