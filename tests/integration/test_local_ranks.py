"""A node of several local ranks is one swarm member (issue #13), on CPU with gloo: real
`swarmtrain peer` processes (one with ``--nproc-per-node 2``), a real hivemind swarm.

- A node of 2 ranks averages with a 1-rank peer for several rounds with identical digests,
  and ends with the same global parameters (float tolerance) as a 1-rank node that trains
  on both ranks' batches at once, with the same partner; and as the same node with its model
  sharded over the two ranks by FSDP2.
- Killing one local rank mid-run, or stopping it (a hung rank), ends its node with a line
  naming the rank; the rest of the swarm carries on.
"""

from __future__ import annotations

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.checkpoint import Checkpointer
from protocol.spec import load_spec
from swarmtrain.localswarm import LocalPeer, wait_all, wait_until
from tests.specs import tiny_spec

ROUNDS = 3
SPEC = tiny_spec(
    "local-ranks",
    d_model=64,
    n_layers=2,
    n_heads=4,
    context=64,
    lr=3e-3,
    batch_size=8,
    inner_steps=5,
    compression="none",
    matchmaking_timeout_s=15.0,
    allreduce_timeout_s=30.0,
    sections={"task": {"kind": '"import"', "factory": '"tests.integration.rank_tasks:bytegpt"'}},
    extra="[task.options]\n{options}\n",
)
PARTNER_SEED, NODE_SEED = 5, 7


def _env(repo_root: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(repo_root)}  # the spec's factory lives in this test package


def _peer(spec: Path, tmp: Path, name: str, seed: int, env: dict[str, str], *extra: str) -> LocalPeer:
    args = ["--spec", str(spec), "--key", str(tmp / f"{name}.key"), "--shard-seed", str(seed)]
    args += ["--host", "127.0.0.1", "--checkpoint-dir", str(tmp / f"{name}-checkpoints"), *extra]
    return LocalPeer(args, tmp, name, env=env)


def _pair(tmp: Path, repo_root: Path, *, options: str, node_args: list[str]) -> dict[str, Any]:
    """A partner (1 rank) and the node under test, ROUNDS rounds; their rows and the node's θ_g."""
    tmp.mkdir()
    spec = tmp / "spec.toml"
    spec.write_text(SPEC.format(options=options, group=2))
    env = _env(repo_root)
    rounds = ["--max-rounds", str(ROUNDS)]
    partner = _peer(spec, tmp, "partner", PARTNER_SEED, env, *rounds)
    node = None
    try:
        node = _peer(
            spec, tmp, "node", NODE_SEED, env, *rounds, "--initial-peers", partner.wait_for_maddr(), *node_args
        )
        for peer, code in zip((partner, node), wait_all((partner, node), 240)):
            assert code == 0, "\n".join(peer.lines[-30:])
    finally:
        for peer in (partner, node):
            if peer is not None:
                peer.kill()
    record = Checkpointer(tmp / "node-checkpoints", spec_digest=load_spec(spec).digest()).latest()
    assert record is not None
    return {"node": node.rounds(), "partner": partner.rounds(), "params": record["params"], "lines": node.lines}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    repo_root = Path(__file__).resolve().parents[2]
    base = tmp_path_factory.mktemp("local-ranks")
    pairs = {
        "two ranks": (base / "two-ranks", "", ["--nproc-per-node", "2"]),
        "one rank, both batches": (base / "one-rank", f"pair_seed = {NODE_SEED}", []),
        "two ranks, fsdp": (base / "fsdp", "", ["--nproc-per-node", "2", "--fsdp", "on"]),
    }
    # the three pairs at once: each is its own swarm (its node dials its own partner), and each
    # spends most of its time starting processes and waiting on its partner, not computing
    with ThreadPoolExecutor(len(pairs)) as pool:
        runs = {
            name: pool.submit(_pair, tmp, repo_root, options=options, node_args=node_args)
            for name, (tmp, options, node_args) in pairs.items()
        }
        return {name: run.result() for name, run in runs.items()}


def _check_swarm(run: dict[str, Any], world_size: int) -> None:
    node, partner = run["node"], run["partner"]
    assert len(node) == len(partner) == ROUNDS
    for mine, theirs in zip(node, partner, strict=True):
        assert mine["averaged"] and theirs["averaged"] and mine["group_size"] == 2, (mine, theirs)
        assert mine["round"] == theirs["round"]
        assert mine["state_digest"] == theirs["state_digest"], (mine["round"], mine, theirs)
        assert mine["local_world_size"] == world_size
        assert mine["samples"] == 2 * theirs["samples"]  # the node's weight: both ranks' samples


def test_a_two_rank_node_and_a_one_rank_peer_average_with_identical_digests(runs: dict[str, Any]) -> None:
    two = runs["two ranks"]
    _check_swarm(two, world_size=2)
    assert any("x 2 local ranks" in line for line in two["lines"])
    assert two["node"][-1]["loss"] < two["node"][0]["loss"]


def test_two_ranks_train_what_one_rank_training_both_batches_trains(runs: dict[str, Any]) -> None:
    two, one = runs["two ranks"], runs["one rank, both batches"]
    _check_swarm(one, world_size=1)
    # DDP sums two half-batch gradients where one rank differentiates the whole batch: equal up
    # to rounding, which AdamW's normalisation magnifies for the few parameters whose gradient is
    # almost zero. 1e-4 is 3% of one inner step's largest update (lr 3e-3).
    torch.testing.assert_close(two["params"], one["params"], rtol=1e-4, atol=1e-4)
    assert not torch.equal(two["params"], torch.zeros_like(two["params"]))
    for a, b in zip(two["node"], one["node"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)


def test_fsdp2_over_two_ranks_trains_what_replicated_ranks_train(runs: dict[str, Any]) -> None:
    two, fsdp = runs["two ranks"], runs["two ranks, fsdp"]
    _check_swarm(fsdp, world_size=2)
    assert any("x 2 local ranks (FSDP2 shards)" in line for line in fsdp["lines"])
    # a reduce-scatter of shards where DDP all-reduces buckets: equal up to rounding (see above)
    torch.testing.assert_close(fsdp["params"], two["params"], rtol=1e-4, atol=1e-4)
    for a, b in zip(two["node"], fsdp["node"], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3)


@pytest.mark.parametrize(
    ("sig", "how"),
    [
        (signal.SIGKILL, r"was killed by SIGKILL"),
        (signal.SIGSTOP, r"stopped responding \(no heartbeat for \d+ s\)"),  # hung, not dead
    ],
    ids=["killed", "stopped"],
)
def test_losing_a_local_rank_ends_its_node_and_the_swarm_carries_on(
    tmp_path: Path, repo_root: Path, sig: signal.Signals, how: str
) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC.format(options="", group=3))
    env = _env(repo_root)
    cap = ["--max-rounds", "200"]  # a bound should the test go wrong; it asks both to leave long before
    peers: list[LocalPeer] = []
    try:
        first = _peer(spec, tmp_path, "first", 1, env, *cap)
        peers.append(first)
        bootstrap = ["--initial-peers", first.wait_for_maddr()]
        peers.append(_peer(spec, tmp_path, "second", 2, env, *cap, *bootstrap))
        ranks = ["--nproc-per-node", "2", "--rank-timeout", "6"]
        node = _peer(spec, tmp_path, "node", NODE_SEED, env, *ranks, *bootstrap)
        peers.append(node)
        pids = node.printed(r"^node: 2 local ranks, pids (\d+ \d+)$", 60).split()
        # the node's first round it averaged in: one that started late on a loaded machine joins
        # as a newcomer does, its first rows failed searches while it catches up (fresh-clone CI)
        wait_until(lambda: any(row["averaged"] for row in node.rounds()), 240, "the node's first averaged round")
        os.kill(int(pids[1]), sig)  # local rank 1, while the node trains its next round
        assert node.wait(timeout=120) != 0
        output = "\n".join(node.lines)
        assert re.search(rf"local rank 1 {how}; the node left the swarm", output), output
        # the swarm carries on after the node is gone, however late it joined (on a loaded
        # machine a node of 2 ranks may take the others' whole run to start): rounds until
        # ``gone + 3`` are landed before both are asked to leave (a round in flight at ``gone``
        # may still have had the node in its group)
        gone = max(row["round"] for row in first.rounds())
        wait_until(
            lambda: all(max((r["round"] for r in p.rounds()), default=0) >= gone + 3 for p in peers[:2]),
            240,
            "three rounds of the others after the node left",
        )
        for peer in peers[:2]:
            peer.leave()
        for peer, code in zip(peers[:2], wait_all(peers[:2], 240)):
            assert code == 0, "\n".join(peer.lines[-30:])
        histories = [{row["round"]: row for row in peer.rounds()} for peer in peers[:2]]
        with_node = [r for r, row in histories[0].items() if row["group_size"] == 3]
        assert with_node, histories[0]  # the node averaged with them before its rank stopped
        after = [r for r in histories[0] if max(with_node) < r <= gone + 3]
        assert len(after) >= 2, histories[0]
        # the node is gone: the two others' rounds since averaged together, to the same state
        for r in after:
            a, b = histories[0][r], histories[1].get(r)
            assert b is not None and a["averaged"] and b["averaged"], (a, b)
            assert a["group_size"] == b["group_size"] == 2 and a["state_digest"] == b["state_digest"], (a, b)
    finally:
        for peer in peers:
            peer.kill()
