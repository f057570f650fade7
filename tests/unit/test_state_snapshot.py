"""The state a member serves is written once per round to a file and streamed from it in the
stream format the downloader parses (``engine.state_snapshot``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hivemind.compression import deserialize_torch_tensor
from hivemind.utils.streaming import combine_from_streaming

from engine.state_snapshot import CHUNK_BYTES, StateSnapshots, chunks
from peer.round.options import TrainerOptions
from peer.round.trainer import Trainer
from peer.task import build_task
from protocol.spec import parse_spec
from tests.unit.recording_swarm import SPEC, RecordingSwarm

NUMEL = CHUNK_BYTES // 4 * 2 + 123  # three chunks per vector, the last one short


def parsed(path: Path, numel: int) -> list[torch.Tensor]:
    """The vectors as ``engine.state_transfer`` reads them from the stream."""
    tensors, parts = [], []
    with path.open("rb") as source:
        for part in chunks(source, numel):
            if part.dtype and parts:
                tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
                parts = []
            parts.append(part)
    tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
    return tensors


def test_the_stream_gives_both_vectors_bit_for_bit(tmp_path: Path) -> None:
    params, momentum = torch.randn(NUMEL), torch.randn(NUMEL)
    params[7] = float("nan")  # bits, not values: whatever is served is what the digest covers
    served = StateSnapshots(tmp_path).write(5, params, momentum, "blake2b:abcdef0123456789ff")
    assert (served["round"], served["digest"], served["numel"]) == (5, "blake2b:abcdef0123456789ff", NUMEL)
    got = parsed(Path(served["snapshot"]), NUMEL)
    assert len(got) == 2 and all(t.dtype == torch.float32 and t.shape == (NUMEL,) for t in got)
    assert got[0].view(torch.int32).equal(params.view(torch.int32)) and got[1].equal(momentum)


def test_one_file_per_round_and_the_last_one_replaced(tmp_path: Path) -> None:
    snapshots = StateSnapshots(tmp_path)
    params = torch.arange(NUMEL, dtype=torch.float32)
    first = Path(snapshots.write(3, params, params, "d3")["snapshot"])
    written = first.stat().st_mtime_ns
    assert Path(snapshots.write(3, params, params, "d3")["snapshot"]) == first  # asked again: not rewritten
    assert first.stat().st_mtime_ns == written
    reader = first.open("rb")  # a download of round 3 under way
    params.add_(1)
    second = Path(snapshots.write(4, params, params, "d4")["snapshot"])
    assert second != first and not first.exists() and list(tmp_path.glob("state-*.bin")) == [second]
    with reader:  # it reads round 3's values to its end
        got = [part.buffer for part in chunks(reader, NUMEL)]
    assert torch.frombuffer(bytearray(b"".join(got)), dtype=torch.float32)[:3].tolist() == [0.0, 1.0, 2.0]
    snapshots.close()
    assert not second.exists()


def test_files_a_crashed_run_left_go_with_the_first_snapshot(tmp_path: Path) -> None:
    (tmp_path / "state-9-0123456789abcdef.bin").write_bytes(b"old")
    (tmp_path / ".state-x.tmp").write_bytes(b"half")
    (tmp_path / "round-9.bin").write_bytes(b"a kept update")
    StateSnapshots(tmp_path).write(1, torch.zeros(4), torch.zeros(4), "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round-9.bin", "state-1-d.bin"]


def test_a_short_file_is_an_error_not_a_short_state(tmp_path: Path) -> None:
    path = tmp_path / "state-1-d.bin"
    path.write_bytes(b"\0" * (NUMEL * 4 + 8))  # the momentum cut off
    with path.open("rb") as source, pytest.raises(OSError, match="short"):
        list(chunks(source, NUMEL))


def test_a_state_of_two_shapes_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="two flat vectors"):
        StateSnapshots(tmp_path).write(1, torch.zeros(4), torch.zeros(5), "d")
    assert not list(tmp_path.glob("state-*"))


def test_a_trainer_serves_its_state_from_its_own_tensors_into_the_file(tmp_path: Path) -> None:
    """No copy of θ_g or the momentum is made to serve them: the writer reads the trainer's own
    tensors, without holding its state lock (a slow disk must not hold up a landing)."""
    spec = parse_spec(SPEC)
    swarm = RecordingSwarm()
    trainer = Trainer(spec, build_task(spec, shard_seed=0), swarm, TrainerOptions(max_rounds=1))  # type: ignore[arg-type]
    seen: list[tuple[int, int, bool]] = []
    snapshots = StateSnapshots(tmp_path)

    def take(round_: int, params: torch.Tensor, momentum: torch.Tensor, digest: str) -> dict[str, object]:
        free = trainer.local.state_lock.acquire(blocking=False)
        if free:
            trainer.local.state_lock.release()
        seen.append((params.data_ptr(), momentum.data_ptr(), free))
        return snapshots.write(round_, params, momentum, digest)

    served = swarm.provider(take)
    state = trainer.state
    assert seen == [(state.params.data_ptr(), state.momentum.data_ptr(), True)]
    assert served["digest"] == state.digest() and served["round"] == state.round
    got = parsed(Path(served["snapshot"]), state.params.numel())
    assert got[0].equal(state.params) and got[1].equal(state.momentum)


def test_a_state_that_changes_while_it_is_written_is_not_served(tmp_path: Path) -> None:
    spec = parse_spec(SPEC)
    swarm = RecordingSwarm()
    trainer = Trainer(spec, build_task(spec, shard_seed=0), swarm, TrainerOptions(max_rounds=1))  # type: ignore[arg-type]
    snapshots = StateSnapshots(tmp_path)

    def landed_meanwhile(round_: int, params: torch.Tensor, momentum: torch.Tensor, digest: str) -> dict[str, object]:
        served = snapshots.write(round_, params, momentum, digest)
        with trainer.local.state_lock:  # a landing: in place, then the next round
            trainer.state.params.add_(1.0)
            trainer.state.round += 1
        return served

    with pytest.raises(RuntimeError, match="changed while it was written"):
        swarm.provider(landed_meanwhile)
    served = swarm.provider(lambda *state: snapshots.write(*state))  # the next ask writes the new state
    assert served["round"] == trainer.state.round and served["digest"] == trainer.state.digest()


def test_without_a_directory_it_makes_one_and_removes_it_on_close() -> None:
    snapshots = StateSnapshots(None)
    path = Path(snapshots.write(2, torch.ones(8), torch.ones(8), "d")["snapshot"])
    assert path.exists() and snapshots.path == path
    snapshots.close()
    assert not path.parent.exists() and snapshots.path is None
