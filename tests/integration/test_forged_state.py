"""Only members vote (protocol.agreement): an outsider that serves a forged state a few rounds
ahead and publishes digest records for it signed by freshly minted keys gets it adopted by
nobody: not by admitted peers or the coordinator's archive in a gated run, not by peers of an
open run (whose electorate is the peers they averaged with)."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch

from engine.codecs import get_codec
from peer.round.round_metrics import RoundMetrics
from peer.round.trainer import Trainer, TrainerOptions
from peer.swarm.swarm import Swarm
from peer.task import build_task
from protocol.agreement import agreed_states
from protocol.identity import Identity
from protocol.membership import MemberGate
from protocol.modelsize import count_params
from protocol.spec import parse_spec
from protocol.statesync import record_votes, run_prefix, state_digest
from swarmtrain.localswarm import LocalCoordinator, LocalPeer, wait_until
from tests.specs import tiny_spec

SPEC = tiny_spec("forged", context=16, inner_steps=2)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
AHEAD = 1_000_000
"""Far ahead: the honest swarm trains on until the newcomer is done, never that far. Two
in-process trainers of this spec land about 20 rounds a second here, so 1,000 rounds ahead was
reached once, while the open-run newcomer spent its first searches at the sybils' round."""
SYBILS = 3
ROUND_PACE_S = 0.5
"""The honest members' pause after each round while the open-run newcomer joins."""
ROUND_WAIT_S = 5.0
"""The longest a member's pause lasts while the newcomer holds an older round than its own."""
ADOPTED = re.compile(r"adopted the swarm's state of round (\d+) \((blake3:[0-9a-f]+)")


class Forger:
    """A process-local outsider: an averager of the run (no token) serving an all-zero state
    ``AHEAD`` rounds ahead, and digest records for it signed by ``SYBILS`` minted keys."""

    def __init__(self, spec_text: str, initial_peers: list[str]) -> None:
        spec = parse_spec(spec_text)
        numel = count_params(spec.task.model)
        self.swarm = Swarm(spec, numel, get_codec("none"), initial_peers=initial_peers, host_maddrs=LOOPBACK)
        self.zeros = torch.zeros(numel)
        self.round = 0
        self.digest = ""

    def forge(self, honest_round: int) -> str:
        self.round = honest_round + AHEAD
        self.digest = state_digest(self.round, self.zeros, self.zeros)
        self.swarm.serve_state(lambda take: take(self.round, self.zeros, self.zeros, self.digest))
        for _ in range(SYBILS):
            self.swarm.run_records.publish_digest(Identity.generate(), round_=self.round, digest=self.digest, wait=True)
        votes = [r for r in self.swarm.records() if r.digest == self.digest]
        assert len(votes) == SYBILS, "the forged records did not reach the DHT"
        return self.digest

    def shutdown(self) -> None:
        self.swarm.shutdown()


def paced(member: Trainer, newcomer: Trainer) -> Callable[[RoundMetrics], None]:
    """``member``'s pause after each round: ``ROUND_PACE_S``, then while ``newcomer``, past its
    first group, holds an older round (up to ``ROUND_WAIT_S``): a real swarm's rounds outlast a
    newcomer's join."""

    def pause(metrics: RoundMetrics) -> None:
        until = time.monotonic() + ROUND_WAIT_S
        time.sleep(ROUND_PACE_S)
        # once the newcomer knows whom to believe (its first group): before, it aims at a round
        # ahead by the pace it measures from the records
        while newcomer.swarm.electorate and newcomer.state.round < member.state.round and time.monotonic() < until:
            time.sleep(0.05)

    return pause


def gated_observer(state_dir: Path, dht_maddr: str) -> Swarm:
    """A swarm of the run (not admitted itself) that applies the run's gate: whose records
    count and which servers it downloads from."""
    spec = parse_spec(SPEC)
    coordinator_key = Identity.load(state_dir / "coordinator.key").public_key
    gate = MemberGate(coordinator_key=coordinator_key, run_digest=spec.digest(), prefix=run_prefix(spec.digest()))
    numel = count_params(spec.task.model)
    return Swarm(spec, numel, get_codec("none"), initial_peers=[dht_maddr], host_maddrs=LOOPBACK, gate=gate)


def get(base: str, path: str) -> dict:
    with urllib.request.urlopen(base + path, timeout=10) as response:
        return json.loads(response.read())


def test_gated_run_neither_peers_nor_the_archive_adopt_an_outsiders_forged_state(tmp_path: Path) -> None:
    spec = tmp_path / "spec.toml"
    spec.write_text(SPEC)
    coordinator = LocalCoordinator(spec, tmp_path / "state", extra=["--archive-every", "1", "--archive-keep", "5"])
    peers: list[LocalPeer] = []
    observers: list[Swarm] = []
    forger: Forger | None = None
    try:
        address, base = coordinator.address(), coordinator.http()
        dht_maddr = coordinator.printed(r"^dht: (\S+)$", 60)

        def admitted(name: str, *extra: str) -> LocalPeer:
            args = ["--coordinator", address, "--host", "127.0.0.1", "--key", str(tmp_path / f"{name}.key"), "-v"]
            return LocalPeer([*args, *extra], tmp_path, name)

        peers = [admitted(f"peer{i}", "--shard-seed", str(i)) for i in range(2)]
        wait_until(lambda: all(len(p.rounds()) >= 2 for p in peers), 180, "the admitted peers to train")
        forger = Forger(SPEC, [dht_maddr])
        forged = forger.forge(max(r["round"] for p in peers for r in p.rounds()))

        # an admitted newcomer catches up: it must take the members' state, not the forged one
        late = admitted("late", "--shard-seed", "7", "--max-rounds", "2", "--wait-for-group", "0")
        peers.append(late)
        assert late.wait(timeout=180) == 0, "\n".join(late.lines[-30:])
        mark = {p.name: len(p.rounds()) for p in peers[:2]}
        wait_until(lambda: all(len(p.rounds()) >= mark[p.name] + 2 for p in peers[:2]), 180, "two more rounds")
        wait_until(lambda: get(base, "api/v1/checkpoints")["checkpoints"], 120, "an archived checkpoint")
        kept = get(base, "api/v1/checkpoints")["checkpoints"]

        # each defence on its own, as an admitted peer's swarm sees the run (gated by this
        # coordinator's key): counting every signer, the forged state would be a round's agreed
        # state; counting members only, it is none; and asked for it, no admitted server has it
        observer = gated_observer(tmp_path / "state", dht_maddr)
        observers.append(observer)
        every_signer = agreed_states(record_votes(observer.records()))
        assert any(state.digest == forged for state in every_signer), every_signer
        assert all(state.digest != forged for state in observer.fallback_states())
        agreed = observer.accepted_state()
        assert agreed is not None and agreed.digest != forged
        assert observer.download_state({forged}, timeout=10) is None
        for peer in peers[:2]:
            peer.stop(grace_s=90)
    finally:
        for peer in peers:
            peer.kill()
        if forger is not None:
            forger.shutdown()
        for observer in observers:
            observer.shutdown()
        coordinator.kill()

    everything = "\n".join(line for p in peers for line in p.lines)
    assert forged[:19] not in everything, "a peer mentioned the forged state"
    adopted = [m for m in map(ADOPTED.search, late.lines) if m]
    assert all(m.group(2) != forged for m in adopted)
    for peer in peers:
        rows = peer.rounds()
        assert rows and all(r["state_digest"] != forged for r in rows), peer.name
    assert kept and all(c["state_digest"] != forged for c in kept), kept


def test_open_run_votes_from_keys_that_never_averaged_do_not_make_a_state_the_swarms() -> None:
    spec = parse_spec(SPEC)
    codec = get_codec(spec.averaging.compression)
    numel = count_params(spec.task.model)
    swarms = [Swarm(spec, numel, codec, initial_peers=[], host_maddrs=LOOPBACK)]
    maddrs = swarms[0].visible_maddrs
    swarms.append(Swarm(spec, numel, codec, initial_peers=maddrs, host_maddrs=LOOPBACK))
    forger: Forger | None = None

    def run_all(trainers: list[Trainer]) -> None:
        threads = [threading.Thread(target=t.run, daemon=True) for t in trainers]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=240)
        assert not any(thread.is_alive() for thread in threads)

    try:
        trainers = [
            Trainer(spec, build_task(spec, shard_seed=i), swarm, TrainerOptions(max_rounds=2))
            for i, swarm in enumerate(swarms)
        ]
        run_all(trainers)
        a, b = trainers
        assert a.state.digest() == b.state.digest() and a.state.round == 2
        forger = Forger(SPEC, maddrs)
        forged = forger.forge(a.state.round)

        # a member's view: only the keys it averaged with count (b's record of round 2 is
        # stored in the background, and a read less than a second old serves: poll for it)
        def agreed_now() -> tuple[int, str] | None:
            agreed = swarms[0].accepted_state(exclude=a.identity.public_key)
            return None if agreed is None else (agreed.round, agreed.digest)

        wait_until(lambda: (agreed_now() or (-1, ""))[0] >= 2, 30, "the member's view of round 2")
        assert agreed_now() == (2, b.state.digest())
        assert all(s.digest != forged for s in swarms[0].fallback_states())

        # a newcomer trusts nobody yet: it adopts nothing from the DHT, and its first group
        # (stale member, weight 0) tells it whom to believe; then it holds the swarm's state
        newcomer_swarm = Swarm(spec, numel, codec, initial_peers=maddrs, host_maddrs=LOOPBACK)
        swarms.append(newcomer_swarm)
        # attempts: the sybils' round and the swarm's in turn (a busy machine can make it miss
        # one meeting), then a round in sync
        newcomer = Trainer(spec, build_task(spec, shard_seed=9), newcomer_swarm, TrainerOptions(max_rounds=5))
        assert newcomer.catch_up() and newcomer.state.round == 0
        # the members train on until the newcomer is done: each round meets at its own DHT key,
        # and the newcomer tries the later rounds it sees, the sybils' among them, in turn
        # at the pace of a real swarm, whose rounds outlast a join: unpaced, two in-process
        # trainers land ~20 rounds a second, and a newcomer (no kept updates to roll forward
        # by, in process) adopts a round the swarm has left before it can launch;
        # they also wait while the newcomer holds an older round than theirs (seconds): a loaded
        # machine (CI's, two sessions of tests on it) took the newcomer 2-5 paced rounds from
        # adopting a state to launching its round, so it met only rounds the swarm had landed
        for trainer in trainers:
            trainer.options.max_rounds = None
            trainer.on_round = paced(trainer, newcomer)
        members = [threading.Thread(target=t.run, daemon=True) for t in trainers]
        for thread in members:
            thread.start()
        run_all([newcomer])
        for trainer in trainers:
            trainer.options.stop.set()
        for thread in members:
            thread.join(timeout=240)
        assert not any(thread.is_alive() for thread in members)
        honest = {row.round: row.state_digest for t in trainers for row in t.history if row.averaged}
        synced = [row for row in newcomer.history if row.averaged and row.in_sync]
        assert synced and all(honest.get(row.round) == row.state_digest for row in synced), newcomer.history
        assert all(
            row.state_digest != forged and row.round < forger.round for t in (*trainers, newcomer) for row in t.history
        )
        assert {a.identity.public_key.id, b.identity.public_key.id} <= newcomer_swarm.electorate
    finally:
        if forger is not None:
            forger.shutdown()
        for swarm in swarms:
            swarm.shutdown()
