"""Where a process sits in its node (torchrun's variables), and how the launcher reports a lost rank."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import pytest

from peer.cli import ranks_to_launch
from peer.node.node import NodeEnv, rank_shard_seed
from protocol.errors import ConfigError
from swarmtrain.node_launcher import describe_exit, rank_env


def test_outside_a_node_there_is_none_and_a_world_of_one_is_a_node() -> None:
    assert NodeEnv.from_environ({}) is None
    one = NodeEnv.from_environ({"WORLD_SIZE": "1", "RANK": "0", "MASTER_PORT": "29500"})
    assert one is not None and (one.rank, one.world_size) == (0, 1)  # a node of one rank


def test_the_launchers_variables_make_the_node_it_meant() -> None:
    env = NodeEnv.from_environ(rank_env(1, 2, 29500))
    assert env == NodeEnv(rank=1, world_size=2, master_addr="127.0.0.1", master_port=29500)


@pytest.mark.parametrize(
    ("environ", "needle"),
    [
        ({"WORLD_SIZE": "two"}, "bad torch.distributed environment"),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "2", "MASTER_PORT": "1"}, "rank 2 of world size 2"),
        ({"WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "0"}, "MASTER_PORT 0"),
        ({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "1"}, "--nnodes 1"),
        ({"WORLD_SIZE": "2", "NNODES": "2", "MASTER_PORT": "1"}, "--nnodes 1"),
    ],
)
def test_a_bad_distributed_environment_is_one_clear_error(environ: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        NodeEnv.from_environ(environ)


def test_the_leader_keeps_the_nodes_shard_and_the_other_ranks_get_their_own() -> None:
    assert rank_shard_seed(7, 0) == 7
    seeds = {rank_shard_seed(7, r) for r in range(8)}
    assert len(seeds) == 8
    assert rank_shard_seed(7, 1) == rank_shard_seed(7, 1) != rank_shard_seed(8, 1)


def _args(**kw: object) -> argparse.Namespace:
    """`swarmtrain peer --spec run.toml`'s flags as its real parser gives them, then ``kw``."""
    from peer.cli import add_parser

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return argparse.Namespace(**{**vars(parser.parse_args(["peer", "--spec", "run.toml"])), **kw})


def test_how_many_ranks_to_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert ranks_to_launch(_args(nproc_per_node=3)) == 3
    assert ranks_to_launch(_args(nproc_per_node=1)) == 1  # asked for: a node of one rank
    assert ranks_to_launch(_args(device="cpu")) is None  # the peer runs in this process
    with pytest.raises(ConfigError, match="--nproc-per-node must be in 1..64"):
        ranks_to_launch(_args(nproc_per_node=0))
    with pytest.raises(ConfigError, match="--rank-timeout must be between 5 and 86400"):
        ranks_to_launch(_args(nproc_per_node=2, rank_timeout=float("nan")))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert ranks_to_launch(_args(nproc_per_node=2)) is None  # already a rank: never launch again
    with pytest.raises(ConfigError, match="torch.distributed says 2 local ranks"):
        ranks_to_launch(_args(nproc_per_node=4))


def test_a_lost_rank_is_described_in_words() -> None:
    assert describe_exit(-signal.SIGKILL) == "was killed by SIGKILL"
    assert describe_exit(3) == "exited with status 3"


def test_fsdp_is_chosen_by_flag_or_only_when_the_training_state_outgrows_a_gpu() -> None:
    from peer.boot.plan import use_fsdp

    assert use_fsdp("on", None, "cpu") and not use_fsdp("off", 10**12, "cuda:0")
    assert not use_fsdp("auto", 10**12, "cpu")  # never on CPU
    assert not use_fsdp("auto", None, "cuda:0")  # size unknown


def test_a_rank_is_silent_only_once_it_has_beaten(tmp_path: Path) -> None:
    from swarmtrain.node_launcher import silent_for

    beat = tmp_path / "rank-1"
    assert silent_for(beat, now=1e9) == 0.0  # still starting
    beat.touch()
    assert silent_for(beat, now=beat.stat().st_mtime + 30) == pytest.approx(30)
