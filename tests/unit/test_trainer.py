"""Trainer logic around the swarm: own bad pseudo-gradients, failed rounds, the outer step.
The swarm here is an in-memory recorder; real swarms are in tests/integration."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

import peer.round.joining
import peer.round.landing
import peer.round.publisher
from engine.checkpoint import Checkpointer
from engine.outcome import AllReduceStats
from peer.round.inner import InnerPhase
from peer.round.joining import FOLLOW_MARGIN_S
from peer.round.round_metrics import RoundMetrics
from peer.round.saving import restore
from peer.round.state import GlobalState, flatten, outer_step
from peer.round.swarm_port import NEGLIGIBLE_WEIGHT, RoundResult
from peer.round.timeouts import AdaptiveTimeouts, matchmaking_window, search_for_window
from peer.round.trainer import Trainer, TrainerOptions
from peer.task import build_task
from protocol.agreement import Agreement
from protocol.gathered import Gathered
from protocol.roster import RosterClaim
from protocol.spec import parse_spec
from protocol.updates import FetchedUpdate
from tests.unit.recording_swarm import SPEC, RecordingSwarm, _Pending


def make_trainer(*, overlap: bool = False) -> tuple[Trainer, RecordingSwarm]:
    spec = parse_spec(SPEC)
    swarm = RecordingSwarm()
    options = TrainerOptions(max_rounds=1, overlap=overlap)
    trainer = Trainer(spec, build_task(spec, shard_seed=1), swarm, options)  # type: ignore[arg-type]
    return trainer, swarm


def test_a_model_gone_non_finite_drops_its_work_reloads_theta_g_and_claims_nothing() -> None:
    trainer, swarm = make_trainer()
    before = trainer.state.clone()
    trainer.optimizer.state[next(trainer.model.parameters())]["exp_avg"] = torch.tensor(float("nan"))
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = float("nan")
    flight = trainer.launcher.launch(InnerPhase(time.monotonic(), math.inf, 2, 0, 0, done=2, samples=4, loss_sum=2.0))
    vector, weight = swarm.launched[0]
    assert weight == NEGLIGIBLE_WEIGHT and bool((vector == 0).all())
    assert flight.samples == 0
    assert torch.equal(flatten(trainer.model), trainer.state.params)  # θ_g reloaded
    assert not trainer.optimizer.state  # the inner optimizer starts afresh
    trainer._land(flight, wait=True)  # the round fails: nothing changes
    assert trainer.state.digest() == before.digest()
    assert trainer.history[-1].samples == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_with_overlap_a_round_looks_for_its_group_as_long_as_the_next_inner_phase_lasts(overlap: bool) -> None:
    """Peers of unequal speed launch apart by up to a round's compute; with overlap, waiting for
    the group costs nothing until the next inner phase ends, so the deadline covers it."""
    trainer, swarm = make_trainer(overlap=overlap)
    base = trainer.timeouts.matchmaking_s
    compute_s = 10 * base
    flight = trainer.launcher.launch(
        InnerPhase(time.monotonic() - compute_s, math.inf, 2, 0, 0, done=2, samples=4, loss_sum=2.0)
    )
    assert (flight.writing is not None) == overlap  # with overlap Δ is written on the landing thread
    if flight.writing is not None:
        trainer.launcher.start_round(flight)
    (timeout,) = swarm.matchmaking_timeouts
    expected = compute_s if overlap else base
    assert timeout == pytest.approx(expected, rel=0.01)
    assert swarm.joinings == [False]  # a member's round: hivemind's short wait for a leader


@pytest.mark.parametrize("newcomer", [False, True])
def test_a_joining_round_declares_its_window_for_its_whole_search(newcomer: bool) -> None:
    """A round launched as a join stays declared for its whole search. With no phase of its own
    a peer that adopted the swarm's state searches long enough to close ``FOLLOW_MARGIN_S``
    after the others' window; an open-run newcomer meeting a round ahead cannot tell when the
    swarm arrives, and its search lasts two matchmaking deadlines when it has no phase to go by."""
    trainer, swarm = make_trainer(overlap=False)
    swarm.newcomer = newcomer
    base = trainer.timeouts.matchmaking_s
    flight = trainer.launcher.launch(InnerPhase(time.monotonic(), time.monotonic(), 0, 0, 0))
    if flight.writing is not None:
        trainer.launcher.start_round(flight)
    (timeout,), (window,) = swarm.matchmaking_timeouts, swarm.windows
    others = matchmaking_window(base)
    assert timeout == pytest.approx(2 * base if newcomer else search_for_window(others + FOLLOW_MARGIN_S))
    assert window == pytest.approx(matchmaking_window(timeout))
    assert window >= others + (0.0 if newcomer else FOLLOW_MARGIN_S) - 1e-6
    assert swarm.joinings == [True]  # a newcomer's search waits longer for a leader's answer


def test_progress_gone_non_finite_while_averaging_is_dropped_at_apply() -> None:
    trainer, swarm = make_trainer(overlap=True)
    averaged = torch.full_like(trainer.state.params, 1e-3)
    swarm.next_result = RoundResult(averaged, 2, [], AllReduceStats(10, 10), 0.0)
    flight = trainer.launcher.launch(InnerPhase(time.monotonic(), math.inf, 2, 0, 0, done=2, samples=4, loss_sum=2.0))
    with torch.no_grad():  # the next round's inner steps diverged meanwhile (overlap)
        next(trainer.model.parameters()).view(-1)[0] = float("inf")
    trainer._land(flight, wait=True)
    trainer.landing.record_landed(wait=True)  # once its digest is known (hashed in the background)
    assert trainer.history[-1].averaged and trainer.state.round == 1
    assert torch.equal(flatten(trainer.model), trainer.state.params)


def test_failed_round_keeps_progress_for_the_next_round() -> None:
    trainer, swarm = make_trainer()
    theta_g = trainer.state.params.clone()
    trainer.run()
    assert trainer.history[0].averaged is False
    assert torch.equal(theta_g, trainer.state.params)
    assert not torch.equal(flatten(trainer.model), trainer.state.params)  # local progress kept
    assert trainer.state.round == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_a_failed_rounds_samples_are_weighed_and_claimed_with_the_round_that_averages_its_work(
    overlap: bool,
) -> None:
    """A round that fails here leaves its work in the model: the next round's pseudo-gradient
    holds both phases' work, so its weight and its claim count both phases' samples (the churn
    lab's failed rounds, 13% of the samples trained, were weighed and credited as if none)."""
    trainer, swarm = make_trainer(overlap=overlap)

    def round_(samples: int, compute_s: float) -> RoundMetrics:
        phase = InnerPhase(time.monotonic() - compute_s, math.inf, 2, 0, 0, done=2, samples=samples, loss_sum=2.0)
        flight = trainer.launcher.launch(phase)
        if flight.writing is not None:
            trainer.launcher.start_round(flight)
        trainer._land(flight, wait=True)
        trainer.landing.record_landed(wait=True)
        return trainer.history[-1]

    failed = round_(4, 1.0)
    assert not failed.averaged and failed.samples == 4 and failed.carried == 0
    swarm.next_result = RoundResult(torch.full_like(trainer.state.params, 1e-3), 2, [], AllReduceStats(10, 10), 0.0)
    landed = round_(6, 2.0)
    assert swarm.launched[-1][1] == 10.0  # its weight: both phases' samples
    assert landed.averaged and (landed.samples, landed.carried) == (6, 4)
    assert landed.claimed[0] == 10 and landed.claimed[1] == pytest.approx(3.0, abs=0.1)
    after = round_(5, 1.0)
    assert (after.samples, after.carried) == (5, 0) and swarm.launched[-1][1] == 5.0  # counted once


def test_successful_round_applies_the_outer_step_to_everyone_alike() -> None:
    trainer, swarm = make_trainer()
    averaged = torch.full_like(trainer.state.params, 1e-3)
    swarm.next_result = RoundResult(averaged, 2, [], AllReduceStats(10, 10), 0.0)
    expected = trainer.state.clone()
    outer_step(expected, averaged, trainer.spec.outer)
    before = time.time()
    trainer.run()
    assert trainer.state.digest() == expected.digest()
    # hashed in the background, then recorded and published, with when it landed (a newcomer
    # that adopts the state times its join by it)
    assert trainer.history[-1].state_digest == expected.digest() and trainer.history[-1].digest_s > 0
    assert swarm.published[-1]["digest"] == expected.digest() and swarm.published[-1]["round_"] == 1
    assert before <= swarm.published[-1]["landed"] <= trainer.history[-1].at + 0.001  # (``at``: to the ms)
    assert torch.equal(flatten(trainer.model), trainer.state.params)


@pytest.mark.parametrize("beside", [frozenset({"ed25519:elsewhere"}), frozenset()], ids=["landed-beside", "alone"])
def test_a_group_that_claims_no_roster_lands_only_if_no_group_beside_it_landed_the_round(
    beside: frozenset[str],
) -> None:
    """The soak's two-state round: after a roster release two groups of two each needed only
    ``min_group_size`` holders, and the second landed round 7 28 s after the first. A group that
    claims no roster now looks first: a peer outside it that landed the round makes it fail
    here (its work carries over and it re-syncs to that state)."""
    trainer, swarm = make_trainer()
    mine = Gathered(id=trainer.identity.public_key.id, round=0, digest=trainer.state.digest())
    members = [mine, replace(mine, id="ed25519:partner")]
    swarm.next_result = RoundResult(
        torch.full_like(trainer.state.params, 1e-3), 2, members, AllReduceStats(10, 10), 0.0
    )
    swarm.beside = beside
    trainer.run()
    assert swarm.fence_checks == [(0, frozenset(m.id for m in members))]
    assert trainer.history[-1].averaged is not bool(beside)
    assert trainer.state.round == (0 if beside else 1)


def test_a_group_holding_its_rosters_majority_needs_no_fence() -> None:
    """Two disjoint groups cannot both hold more than half of one roster: no lookup is spent."""
    trainer, swarm = make_trainer()
    mine = Gathered(id=trainer.identity.public_key.id, round=0, digest=trainer.state.digest(), roster=2, known=True)
    members = [mine, replace(mine, id="ed25519:partner")]
    swarm.next_result = RoundResult(
        torch.full_like(trainer.state.params, 1e-3), 2, members, AllReduceStats(10, 10), 0.0
    )
    swarm.beside = frozenset({"ed25519:elsewhere"})
    trainer.run()
    assert swarm.fence_checks == [] and trainer.history[-1].averaged and trainer.state.round == 1


def test_with_overlap_the_inner_steps_go_on_while_the_round_lands(monkeypatch: pytest.MonkeyPatch) -> None:
    """The landing's host half (residual, outer step, the re-base shift) runs on the landing
    thread: one that waits for inner steps to happen sees them happen (on the training thread
    it would wait in vain), the round still lands the outer step everyone takes, and the model
    is re-based onto it with its progress since the launch. Each phase ends once a landing
    finished during it (the first after two steps), not by a time budget: a busy machine's
    steps took longer than a 3 s phase left the landing, which then waited for steps in vain."""
    import threading

    real, busy, stepped = peer.round.landing.land_global, threading.Event(), threading.Event()
    saw_steps: list[bool] = []
    landed: list[bool] = []

    def land_global_waiting_for_steps(*args: Any, **kwargs: Any) -> None:
        busy.set()
        saw_steps.append(stepped.wait(timeout=30))
        real(*args, **kwargs)
        landed.append(True)
        busy.clear()

    monkeypatch.setattr(peer.round.landing, "land_global", land_global_waiting_for_steps)
    spec = parse_spec(
        SPEC.replace("inner_steps = 2", "inner_steps = 100000").replace("[rounds]", "[rounds]\ntime_budget_s = 120.0")
    )
    swarm = RecordingSwarm()
    trainer = Trainer(spec, build_task(spec, shard_seed=1), swarm, TrainerOptions(max_rounds=2, overlap=True))  # type: ignore[arg-type]
    averaged = torch.full_like(trainer.state.params, 1e-3)
    swarm.next_result = RoundResult(averaged, 2, [], AllReduceStats(10, 10), 0.0)
    expected = trainer.state.clone()
    outer_step(expected, averaged, spec.outer)
    outer_step(expected, averaged, spec.outer)
    during: list[int] = []
    step = trainer._train_step

    phases: list[tuple[InnerPhase, int]] = []  # each phase (held: an id is reused) and the landings before it

    def counted_step(inner: InnerPhase) -> None:
        if not phases or phases[-1][0] is not inner:
            phases.append((inner, len(landed)))
        began = phases[-1][1]
        if busy.is_set():
            during.append(inner.done)
            stepped.set()
        step(inner)
        if (len(phases) == 1 and inner.done >= 2) or len(landed) > began:
            inner.steps = inner.done  # this phase did its part: end it

    trainer._train_step = counted_step  # type: ignore[method-assign]
    trainer.run()
    assert saw_steps and saw_steps[0], "the inner steps waited for the landing"
    first = trainer.history[0]
    assert first.averaged and first.landing_s > 0
    assert trainer.state.round == 2 and trainer.state.digest() == expected.digest()
    # the model: θ_g plus the progress of the inner steps since the last launch
    assert not torch.equal(flatten(trainer.model), trainer.state.params)


def test_with_overlap_the_pseudo_gradient_is_written_off_the_training_thread_with_the_same_bytes() -> None:
    """The launch reads the launch point on the training thread and writes Δ = θ_g − launch
    point (+ the codec residual) on the landing thread while the next inner steps change the
    model: the vector sent is the launch's, bit for bit, and the round starts only then."""
    import threading

    sent = {}
    for overlap in (False, True):
        trainer, swarm = make_trainer(overlap=overlap)
        with torch.no_grad():  # an inner phase's progress
            for p in trainer.model.parameters():
                p.add_(torch.full_like(p, 0.01))
        expected = torch.sub(trainer.state.params, flatten(trainer.model))
        gate = threading.Event()
        write = trainer.launcher.write_delta

        def held_write(*args: Any, write: Any = write, gate: threading.Event = gate) -> bool:
            assert gate.wait(10)
            return write(*args)

        trainer.launcher.write_delta = held_write  # type: ignore[method-assign]
        if overlap:
            flight = trainer.launcher.launch(
                InnerPhase(time.monotonic(), math.inf, 2, 0, 0, done=2, samples=4, loss_sum=2.0)
            )
            assert not swarm.launched and flight.writing is not None  # not started while Δ is written
            with torch.no_grad():  # the next inner steps move the model meanwhile
                for p in trainer.model.parameters():
                    p.add_(torch.full_like(p, 1.0))
            gate.set()
            trainer.launcher.start_round(flight)
        else:
            trainer.launcher.launch(InnerPhase(time.monotonic(), math.inf, 2, 0, 0, done=2, samples=4, loss_sum=2.0))
        ((vector, weight),) = swarm.launched
        assert weight == 4.0
        sent[overlap] = vector
    assert torch.equal(sent[True].view(torch.int32), sent[False].view(torch.int32))
    assert torch.allclose(sent[False], expected, atol=1e-6)


def test_outer_step_matches_torch_nesterov_sgd() -> None:
    spec = parse_spec(SPEC)
    params = torch.randn(1000)
    state = GlobalState(params.clone(), torch.zeros(1000), 0)
    reference = torch.nn.Parameter(params.clone())
    sgd = torch.optim.SGD([reference], lr=spec.outer.lr, momentum=spec.outer.momentum, nesterov=True)
    for _ in range(3):
        delta = torch.randn(1000)
        outer_step(state, delta, spec.outer)
        reference.grad = delta.clone()
        sgd.step()
    assert torch.allclose(state.params, reference.detach(), atol=1e-6) and state.round == 3


def test_outer_step_is_bitwise_reproducible() -> None:
    spec = parse_spec(SPEC)
    delta = torch.randn(4097)
    a = GlobalState(torch.randn(4097, generator=torch.Generator().manual_seed(0)), torch.zeros(4097), 5)
    b = a.clone()
    outer_step(a, delta, spec.outer)
    outer_step(b, delta.clone(), spec.outer)
    assert a.digest() == b.digest()


def test_checkpoint_resume_restores_everything(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = parse_spec(SPEC)
    swarm = RecordingSwarm()
    options = TrainerOptions(max_rounds=2, checkpoint_dir=tmp_path)
    trainer = Trainer(spec, build_task(spec, shard_seed=1), swarm, options)  # type: ignore[arg-type]
    swarm.next_result = RoundResult(torch.full_like(trainer.state.params, 1e-3), 2, [], AllReduceStats(1, 1), 0.0)
    trainer.run()
    assert trainer.state.round == 2 and len(list(tmp_path.glob("round-*.pt"))) == 2

    resumed = Trainer(spec, build_task(spec, shard_seed=1), RecordingSwarm(), TrainerOptions(checkpoint_dir=tmp_path))  # type: ignore[arg-type]
    assert resumed.state.digest() == trainer.state.digest()
    assert resumed.inner_steps_done == trainer.inner_steps_done
    assert torch.equal(flatten(resumed.model), flatten(trainer.model))
    assert torch.equal(resumed.feedback.residual, trainer.feedback.residual)  # type: ignore[union-attr]
    # its digest record says again when it landed that state: a group that released its roster
    # fences on it (the soak: a pair landed round 18, both members restarted within seconds,
    # their records lost the landing time, and a rosterless group beside them landed 18 too)
    assert trainer.publisher.snapshot[2] is not None and resumed.publisher.snapshot == trainer.publisher.snapshot


def test_corrupted_or_foreign_checkpoints_are_skipped(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from engine.checkpoint import Checkpointer

    good = Checkpointer(tmp_path, spec_digest="sha256:run")
    params, momentum = torch.ones(10), torch.zeros(10)
    good.save({"round": 1, "params": params, "momentum": momentum})
    newest = good.save({"round": 2, "params": params * 2, "momentum": momentum})
    record = torch.load(newest, weights_only=True)
    record["params"][0] = 99.0  # edited after the fact
    torch.save(record, newest)
    assert good.latest()["round"] == 1  # type: ignore[index]
    newest.write_bytes(b"torn")
    assert good.latest()["round"] == 1  # type: ignore[index]
    assert Checkpointer(tmp_path, spec_digest="sha256:other").latest() is None


def test_first_round_waits_for_the_group_then_gives_up_at_its_deadline() -> None:
    spec = parse_spec(SPEC.replace("[averaging]", "[averaging]\nmin_group_size = 3"))
    swarm = RecordingSwarm(others={"ed25519:a"})
    options = TrainerOptions(max_rounds=1, wait_for_group_s=0.3)
    trainer = Trainer(spec, build_task(spec, shard_seed=1), swarm, options)  # type: ignore[arg-type]
    assert trainer.wait_for_group() is False  # 2 of 3 until the deadline
    swarm.others.add("ed25519:b")
    options.wait_for_group_s = 3600.0
    assert trainer.wait_for_group() is True  # at once: 3 of 3
    swarm.others.clear()
    options.stop.set()
    assert trainer.wait_for_group() is False  # a stop request ends the wait


class Journal:
    """What the trainer tells the coordinator link about reports (``RoundJournal``), in order."""

    def __init__(self, unfinished: tuple[tuple[int, str], ...] = ()) -> None:
        self.said: list[tuple[str, int, str]] = []
        self.started_from: list[str] = []
        self.left = list(unfinished)
        """Unfinished reports a previous run left: (round, the digest it started from)."""

    def landing(self, metrics: RoundMetrics, pre: str) -> None:
        self.said.append(("landing", metrics.round, metrics.state_digest))
        self.started_from.append(pre)

    def unfinished(self) -> list[tuple[int, str]]:
        return list(self.left)

    def holds(self, round_: int, digest: str) -> None:
        self.said.append(("holds", round_, digest))
        self.left = [(r, pre) for r, pre in self.left if r > round_]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_round_says_it_lands_before_it_is_recorded_and_a_resumed_peer_what_it_holds(
    tmp_path: Path, overlap: bool
) -> None:
    """The report of a round begins when its all-reduce returns, numbered as the round it
    becomes (a peer killed in its landing finishes it once it holds that state again)."""
    spec = parse_spec(SPEC)
    swarm, journal = RecordingSwarm(), Journal()
    options = TrainerOptions(max_rounds=2, checkpoint_dir=tmp_path, overlap=overlap)
    trainer = Trainer(spec, build_task(spec, shard_seed=1), swarm, options, journal=journal)  # type: ignore[arg-type]
    assert journal.said == []  # nothing to resume
    swarm.next_result = RoundResult(torch.full_like(trainer.state.params, 1e-3), 2, [], AllReduceStats(1, 1), 0.0)
    trainer.on_round = lambda m: journal.said.append(("round", m.round, m.state_digest))
    trainer.run()
    assert [(what, r) for what, r, _ in journal.said] == [("landing", 1), ("round", 1), ("landing", 2), ("round", 2)]
    assert [d for what, _, d in journal.said if what == "landing"] == ["", ""]
    assert journal.started_from[0] == GlobalState.from_model(build_task(spec, shard_seed=1).model).digest()
    resumed = Journal()
    Trainer(
        spec, build_task(spec, shard_seed=1), RecordingSwarm(), TrainerOptions(checkpoint_dir=tmp_path), journal=resumed
    )  # type: ignore[arg-type]
    assert resumed.said == [("holds", 2, trainer.state.digest())]


def test_catch_up_falls_back_to_the_newest_state_someone_still_serves() -> None:
    spec = parse_spec(SPEC)
    task = build_task(spec, shard_seed=1)
    served = GlobalState.from_model(task.model)
    served = GlobalState(served.params + 0.5, served.momentum, 3)

    class Averager:
        state_provider = None
        asked: list[set[str]] = []

        def load_verified_state(self, accept: set[str], timeout: float) -> Any:
            self.asked.append(set(accept))
            return (3, served.params, served.momentum) if served.digest() in accept else None

    class Swarm(RecordingSwarm):
        def accepted_state(self, **kwargs: Any) -> Agreement:
            return Agreement(5, "sha256:round5", 1, 1)  # nobody serves it any more

        def fallback_states(self, **kwargs: Any) -> list[Agreement]:
            return [
                Agreement(r, d, 1, 1) for r, d in ((5, "sha256:round5"), (4, "sha256:round4"), (3, served.digest()))
            ]

    swarm = Swarm()
    swarm.averager = Averager()
    journal = Journal()
    trainer = Trainer(spec, task, swarm, TrainerOptions(max_rounds=1), journal=journal)  # type: ignore[arg-type]
    assert trainer.catch_up()
    assert trainer.state.round == 3 and trainer.state.digest() == served.digest()
    assert journal.said == [("holds", 3, served.digest())]  # a report its last run left for round 3 goes
    assert Averager.asked == [{"sha256:round5"}, {"sha256:round4"}, {served.digest()}]  # newest first


@pytest.mark.parametrize("kept", [True, False], ids=["kept", "nobody-keeps-it"])
def test_a_report_left_landing_is_finished_by_its_rounds_update_when_the_peer_adopts_a_later_state(
    kept: bool,
) -> None:
    """The soak's last lost credit: a member killed while it landed round 3 came back after the
    swarm moved on and took round 5's state by download; it never held round 3's, so its report
    went unfinished and its pair was credited nothing. The round's update, which members keep,
    names the state it made: the report is finished with that digest before round 5 is held."""
    spec = parse_spec(SPEC)
    task = build_task(spec, shard_seed=1)
    served = GlobalState.from_model(task.model)
    served = GlobalState(served.params + 0.5, served.momentum, 5)
    update = FetchedUpdate(2, "sha256:pre2", "sha256:post3", [], [], 0.1, "server")

    class Averager:
        state_provider = None

        def load_verified_state(self, accept: set[str], timeout: float) -> Any:
            return (5, served.params, served.momentum) if served.digest() in accept else None

    class Swarm(RecordingSwarm):
        asked: list[tuple[int, str]] = []

        def accepted_state(self, **kwargs: Any) -> Agreement:
            return Agreement(5, served.digest(), 2, 2)

        def download_update(self, round_: int, digest: str, *, timeout: float) -> Any:
            self.asked.append((round_, digest))
            return update if kept and (round_, digest) == (2, "sha256:pre2") else None

    swarm = Swarm()
    swarm.averager = Averager()
    journal = Journal(unfinished=((3, "sha256:pre2"),))
    trainer = Trainer(spec, task, swarm, TrainerOptions(max_rounds=1), journal=journal)  # type: ignore[arg-type]
    assert trainer.catch_up() and trainer.state.round == 5
    assert (2, "sha256:pre2") in swarm.asked
    finished = [("holds", 3, "sha256:post3")] if kept else []
    assert journal.said == [*finished, ("holds", 5, served.digest())]


def test_a_failed_round_while_the_swarm_moved_on_re_syncs_before_training_on() -> None:
    """Others averaged without this peer (its round failed): it adopts their state now instead
    of training a round that its next group would count for nothing."""
    spec = parse_spec(SPEC)
    task = build_task(spec, shard_seed=1)
    start = GlobalState.from_model(task.model)
    theirs = GlobalState(start.params + 0.25, start.momentum, 1)

    class Averager:
        state_provider = None

        def load_verified_state(self, accept: set[str], timeout: float) -> Any:
            return (1, theirs.params, theirs.momentum) if theirs.digest() in accept else None

    class Swarm(RecordingSwarm):
        def accepted_state(self, **kwargs: Any) -> Agreement | None:
            return Agreement(1, theirs.digest(), 1, 1) if self.launched else None  # published while we averaged

    swarm = Swarm()
    swarm.averager = Averager()
    trainer = Trainer(spec, task, swarm, TrainerOptions(max_rounds=1))  # type: ignore[arg-type]
    trainer.run()
    row = trainer.history[0].as_dict()
    assert not row["averaged"] and row["in_sync"]
    assert trainer.state.round == 1 and trainer.state.digest() == theirs.digest() == row["state_digest"]
    assert torch.equal(trainer.state.params, theirs.params)
    # its round's work, counted by nobody, is carried onto their state for the next round
    [(vector, _)] = swarm.launched  # = start - local (first round: no codec residual yet)
    assert bool(vector.any()) and torch.equal(flatten(trainer.model), torch.add(theirs.params, -vector))


def test_a_failed_round_with_nobody_ahead_keeps_this_peer_s_state() -> None:
    trainer, swarm = make_trainer()
    swarm.accepted_state = lambda **kwargs: Agreement(0, trainer.state.digest(), 1, 1)  # type: ignore[method-assign]
    before = trainer.state.digest()
    trainer.run()
    assert trainer.state.digest() == before and trainer.history[0].in_sync


def test_the_progress_display_sees_every_inner_step_and_the_wait_for_averaging() -> None:
    from peer.round.progress import InnerProgress

    class Sink:
        def __init__(self) -> None:
            self.events: list[Any] = []

        def inner_step(self, progress: InnerProgress) -> None:
            self.events.append(progress)

        def waiting(self, round_: int) -> None:
            self.events.append(("waiting", round_))

        def joining(self, text: str) -> None:
            self.events.append(("joining", text))

    class SlowPending(_Pending):
        def done(self) -> bool:
            return False

    class Swarm(RecordingSwarm):
        def start_round(
            self, *, weight: float, gather: Gathered, timeout: float, window: float = 0.0, joining: bool = False
        ) -> _Pending:
            super().start_round(weight=weight, gather=gather, timeout=timeout, window=window)
            return SlowPending(None)

    spec = parse_spec(SPEC)
    sink = Sink()
    trainer = Trainer(spec, build_task(spec, shard_seed=1), Swarm(), TrainerOptions(max_rounds=2), progress=sink)  # type: ignore[arg-type]
    trainer.run()
    steps = [event for event in sink.events if isinstance(event, InnerProgress)]
    assert [(p.round, p.step, p.steps, p.samples) for p in steps] == [(0, 1, 2, 2), (0, 2, 2, 4)] * 2
    assert all(p.loss > 0 and p.elapsed_s > 0 and p.budget_s is None for p in steps)
    assert [event for event in sink.events if isinstance(event, tuple)] == [("waiting", 0)] * 2


def _adopting_trainer(ahead_by: int) -> tuple[Trainer, RecordingSwarm, GlobalState]:
    """A trainer whose swarm publishes, once this peer has launched a round, a state
    ``ahead_by`` rounds beyond this peer's."""
    spec = parse_spec(SPEC)
    task = build_task(spec, shard_seed=1)
    start = GlobalState.from_model(task.model)
    theirs = GlobalState(start.params + 0.25, start.momentum, ahead_by)

    class Averager:
        state_provider = None

        def load_verified_state(self, accept: set[str], timeout: float) -> Any:
            return (theirs.round, theirs.params, theirs.momentum) if theirs.digest() in accept else None

    class Swarm(RecordingSwarm):
        def accepted_state(self, **kwargs: Any) -> Agreement | None:
            return Agreement(theirs.round, theirs.digest(), 1, 1) if self.launched else None

    swarm = Swarm()
    swarm.averager = Averager()
    return Trainer(spec, task, swarm, TrainerOptions(max_rounds=1)), swarm, theirs  # type: ignore[arg-type]


def test_a_stale_member_carries_the_round_its_group_weighed_zero_onto_the_adopted_state() -> None:
    trainer, swarm, theirs = _adopting_trainer(ahead_by=1)
    majority = [Gathered(id=f"ed25519:{n}", round=0, digest="sha256:theirs") for n in "ab"]
    mine = Gathered(id=trainer.identity.public_key.id, round=0, digest=trainer.state.digest())
    swarm.next_result = RoundResult(
        torch.full_like(trainer.state.params, 1e-3), 3, [*majority, mine], AllReduceStats(10, 10), 0.0
    )
    trainer.run()
    assert trainer.state.digest() == theirs.digest() and trainer.in_sync
    [(vector, _)] = swarm.launched
    assert torch.equal(flatten(trainer.model), torch.add(theirs.params, -vector))


@pytest.mark.parametrize("holders", [2, 1])
def test_a_member_a_reducer_failed_is_back_in_the_roster_of_the_state_its_group_made(holders: int) -> None:
    """Its group landed the round without it; it adopts that state by download, and if more
    than half of the group's roster publish that they hold it, it claims its place in it, so
    the next round's leader does not wait out its window for it."""
    trainer, swarm, theirs = _adopting_trainer(ahead_by=1)
    mine = Gathered(id=trainer.identity.public_key.id, round=0, digest=trainer.state.digest())
    others = [replace(mine, id=f"ed25519:{n}") for n in "ab"]
    result = RoundResult(torch.full_like(trainer.state.params, 1e-3), 3, [mine, *others], AllReduceStats(10, 10), 0.0)
    result.stats.missing = [(0, 8)]
    swarm.next_result = result
    swarm.claim = RosterClaim(3, frozenset(m.id for m in others[:holders]))
    trainer.run()
    assert trainer.state.digest() == theirs.digest() and not trainer.history[-1].averaged
    assert (trainer.roster.size, trainer.roster.known) == (3, holders == 2)
    assert swarm.seen == [m.id for m in [mine, *others]]  # their records count: they are its group
    # its record claims the roster only if it is in it: an adopter's record says nothing
    assert swarm.published[-1]["roster"] == (3 if holders == 2 else 0)
    # its work: averaged in by its group, whose state it adopted (the group's reporters name it):
    # carried again it would be weighed and claimed twice. Onto another state it is carried.
    [(vector, _)] = swarm.launched
    if holders == 2:
        assert torch.equal(flatten(trainer.model), theirs.params) and trainer.local.unlanded == (0, 0.0)
    else:
        assert torch.equal(flatten(trainer.model), torch.add(theirs.params, -vector))
        assert trainer.local.unlanded[0] > 0


def test_work_more_than_two_rounds_stale_is_dropped() -> None:
    trainer, swarm, theirs = _adopting_trainer(ahead_by=3)
    trainer.run()
    assert trainer.state.digest() == theirs.digest()
    assert torch.equal(flatten(trainer.model), theirs.params)


def test_non_finite_local_work_is_never_carried() -> None:
    trainer, swarm, theirs = _adopting_trainer(ahead_by=1)
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = float("inf")
    swarm.launched.append((torch.zeros(1), 1.0))  # the swarm now shows its later state
    assert trainer.catch_up() is True
    assert torch.equal(flatten(trainer.model), theirs.params)


def test_the_digest_record_is_re_signed_while_a_long_round_runs(monkeypatch: Any) -> None:
    """Records expire after RECORD_TTL_S: a round longer than that must not leave newcomers
    without this peer's vote."""
    trainer, swarm = make_trainer()
    monkeypatch.setattr(peer.round.publisher, "REPUBLISH_S", 0.0)
    digest = trainer.state.digest()
    trainer.run()  # 2 inner steps: re-signed at each, without computing a new digest
    steps = [p for p in swarm.published if p == {"round_": 0, "digest": digest, "roster": 0, "landed": None}]
    assert len(steps) >= 2


def test_a_failed_round_trains_again_on_new_pages_and_the_cursor_is_checkpointed(tmp_path: Path) -> None:
    trainer, _swarm = make_trainer(overlap=True)
    first = trainer.inner.open(ahead=False)
    ahead = trainer.inner.open(ahead=True)  # round 0 averages while round 1's steps run
    assert (first.round, first.data_round, ahead.round, ahead.data_round) == (0, 0, 1, 1)
    # round 0 failed (the state stays at round 0): it is relaunched while the next steps run;
    # they train for round 1 again (its learning rate) but read data round 2, never 1 again
    again = trainer.inner.open(ahead=True)
    assert (again.round, again.data_round) == (1, 2)
    trainer.state.round = 7  # a re-sync jumped ahead: the data follows the swarm
    assert trainer.inner.open(ahead=False).data_round == 7
    trainer.checkpointer = Checkpointer(tmp_path, spec_digest=trainer.spec.digest())
    trainer.save_checkpoint()
    restarted, _ = make_trainer(overlap=True)
    restarted.checkpointer = Checkpointer(tmp_path, spec_digest=trainer.spec.digest())
    assert restarted.checkpointer is not None
    restore(restarted.checkpointer, restarted.local, feedback=restarted.feedback, sharded=False, journal=None)
    assert restarted.inner.open(ahead=False).data_round == 8


def test_a_peer_told_to_leave_while_out_of_sync_launches_no_round_from_its_stale_state() -> None:
    """Its round failed, the swarm moved on and the leave cut its re-sync short: the round of
    the inner phase it was training would start from a state the swarm has left."""
    spec = parse_spec(SPEC)
    ahead = GlobalState.from_model(build_task(spec, shard_seed=1).model)
    agreed = Agreement(1, GlobalState(ahead.params + 1.0, ahead.momentum, 1).digest(), 1, 1)

    class Swarm(RecordingSwarm):
        def accepted_state(self, **kwargs: Any) -> Agreement | None:
            if self.launched:
                trainer.options.stop.set()  # the leave arrives while the round fails
                return agreed
            return None

    swarm = Swarm()
    trainer = Trainer(spec, build_task(spec, shard_seed=1), swarm, TrainerOptions(max_rounds=5, overlap=True))  # type: ignore[arg-type]
    trainer.run()
    assert len(swarm.launched) == 1, "a second round was launched from the stale state"
    assert [row.in_sync for row in trainer.history] == [False]


def test_rounds_that_find_no_group_release_the_roster_claim() -> None:
    """Matchmaking never starts a group the roster rule would refuse, so a swarm that lost its
    roster's majority sees failed rounds: after ``ROSTER_RELEASE_AFTER`` of them at one state
    the peer stops claiming the roster's size (else two peers, one no longer known, wait
    forever); it is still one of the roster (``known``)."""
    from protocol.roster import ROSTER_RELEASE_AFTER

    spec = parse_spec(SPEC)
    swarm = RecordingSwarm()  # every round fails: no group
    trainer = Trainer(spec, build_task(spec, shard_seed=1), swarm, TrainerOptions(max_rounds=ROSTER_RELEASE_AFTER))  # type: ignore[arg-type]
    trainer.roster.size, trainer.roster.known = 2, True
    trainer.run()
    assert [row.averaged for row in trainer.history] == [False] * ROSTER_RELEASE_AFTER
    assert (trainer.roster.size, trainer.roster.known) == (0, True)


def test_a_landed_round_still_hashing_counts_once_toward_the_runs_last_round() -> None:
    """``rounds.max_rounds``: the state's round already counts a landed round whose digest is
    still being hashed; counting it again stopped a peer one round short of the run's end
    whenever the hash was slower than the loop (overlap off)."""
    spec = parse_spec(SPEC.replace("inner_steps = 2", "inner_steps = 2\nmax_rounds = 2"))
    trainer = Trainer(spec, build_task(spec, shard_seed=1), RecordingSwarm(), TrainerOptions())  # type: ignore[arg-type]
    trainer.state.round = 1
    trainer.landing.unrecorded = object()  # type: ignore[assignment]  # round 0 landed, its digest not yet recorded
    assert not trainer._finished(None)
    trainer.state.round = 2
    assert trainer._finished(None)


@pytest.mark.parametrize("late", [False, True], ids=["missed-the-last-round", "joined-after-the-end"])
def test_a_peer_the_run_ended_without_stops_instead_of_training_alone(late: bool) -> None:
    """The swarm landed the run's final round (``rounds.max_rounds``) without this peer and the
    others left, so nobody serves that state: the peer stops. An older state someone still
    serves would only have it train rounds that nobody averages any more (it looped so, and
    never exited, when the others were gone)."""
    spec = parse_spec(SPEC.replace("inner_steps = 2", "inner_steps = 2\nmax_rounds = 3"))
    older = Agreement(2, "sha256:round2", 1, 1)

    class Swarm(RecordingSwarm):
        def accepted_state(self, **kwargs: Any) -> Agreement | None:
            return Agreement(3, "sha256:final", 2, 2) if late or self.launched else None

        def fallback_states(self, **kwargs: Any) -> list[Agreement]:
            self.fell_back = True
            return [older]

    swarm = Swarm()
    trainer = Trainer(spec, build_task(spec, shard_seed=1), swarm, TrainerOptions(wait_for_group_s=30))  # type: ignore[arg-type]
    started = time.monotonic()
    trainer.run()
    assert trainer.missed_end == 3
    assert len(swarm.launched) == (0 if late else 1) and not hasattr(swarm, "fell_back")
    assert [row.averaged for row in trainer.history] == ([] if late else [False])
    assert trainer.state.round == 0 and time.monotonic() - started < 10


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _two_mirrored_rounds(
    device: str, mirror: bool | None, overlap_start: str
) -> tuple[list[torch.Tensor], str, torch.Tensor, list[float | None], bool]:
    """Two rounds of an overlapping trainer driven by hand (the same progress, the same
    averages): the vectors it sent, its digest, its model, its validation losses, whether it
    made a mirror."""
    spec = parse_spec(SPEC + f'overlap_start = "{overlap_start}"\n[eval]\nevery_rounds = 1\nbatches = 2\n')
    swarm = RecordingSwarm()
    options = TrainerOptions(max_rounds=3, overlap=True, device=device, device_mirror=mirror)
    trainer = Trainer(spec, build_task(spec, shard_seed=1, device=device), swarm, options)  # type: ignore[arg-type]
    assert trainer.task.eval_batches is not None
    val_losses: list[float | None] = []
    trainer.on_round = lambda metrics: val_losses.append(metrics.val_loss)
    for round_ in range(2):
        with torch.no_grad():  # an inner phase's progress
            for i, p in enumerate(trainer.model.parameters()):
                p.add_(torch.full_like(p, 0.01 * (i + 1 + round_)))
        flight = trainer.launcher.launch(
            InnerPhase(time.monotonic(), math.inf, 2, round_, round_, done=2, samples=4, loss_sum=2.0)
        )
        with torch.no_grad():  # the next inner steps move the model meanwhile
            for p in trainer.model.parameters():
                p.mul_(1.001)
        trainer.launcher.start_round(flight)
        averaged = torch.full_like(trainer.state.params, 1e-3 * (round_ + 1))
        flight.pending = _Pending(RoundResult(averaged, 2, [], AllReduceStats(10, 10), 0.0))
        assert trainer._land(flight, wait=True)
        if trainer.local.mirror is not None:
            assert trainer.local.mirror.holds_theta(trainer.state.params, trainer.state.round)
        before = flatten(trainer.model)
        trainer.landing.record_landed(wait=True)
        assert torch.equal(flatten(trainer.model), before)  # the validation swapped θ_g in and back
    assert trainer.state.round == 2 and all(v is not None for v in val_losses)
    sent = [v for v, _ in swarm.launched]
    return sent, trainer.state.digest(), flatten(trainer.model), val_losses, trainer.local.mirror is not None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap_start", ["local", "eager"])
def test_a_device_mirror_lands_the_same_bytes_as_the_host_path(device: str, overlap_start: str) -> None:
    """With overlap, a mirror of the launch point on the model's device (``peer.round.device_mirror``:
    captured device to device at the launch, downloaded and re-based through on the landing
    thread, θ_g staged there for the validation) sends, lands and validates exactly what the
    host path does (on a GPU: through the pinned launch point, asynchronously); the validation
    leaves the model as it found it. On a CPU the "device" is the host; an eager start keeps the
    host path. Where a GPU is present, the automatic choice is checked too."""
    modes: list[bool | None] = [False, True] + ([None] if device == "cuda" else [])
    runs = {mode: _two_mirrored_rounds(device, mode, overlap_start) for mode in modes}
    sent_host, digest_host, model_host, val_host, made = runs[False]
    assert not made
    for mode in modes[1:]:
        sent, digest, model, val, made = runs[mode]
        assert made == (overlap_start == "local" and (mode is True or device == "cuda"))
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(sent_host, sent, strict=True))
        assert digest == digest_host
        assert torch.equal(model.view(torch.int32), model_host.view(torch.int32))
        assert val == val_host


def test_a_mirror_is_made_only_where_a_cuda_device_has_room() -> None:
    from peer.round.device_mirror import room_for

    assert not room_for(torch.device("cpu"), 1, 10)  # a host "mirror" would be one more host copy
    trainer, _ = make_trainer(overlap=True)
    assert trainer.launcher.mirrored() is None and trainer.local.mirror_decided  # auto on a CPU model: none


@dataclass
class _Searching:
    """A round still looking for its group until abandoned (then it failed)."""

    meets: int
    abandoned: bool = False

    def done(self) -> bool:
        return self.abandoned

    def wait(self, timeout: float) -> bool:
        time.sleep(min(timeout, 0.01))
        return self.abandoned

    def result(self) -> RoundResult | None:
        assert self.abandoned
        return None

    def abandon(self) -> bool:
        self.abandoned = True
        return True


@pytest.mark.parametrize("landed", [False, True])
def test_a_peer_gives_up_a_search_for_a_round_the_swarm_landed_without_it(
    landed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round whose group formed without this peer (it adopted a state while the swarm moved
    on, or launched late) is given up as soon as the records show the swarm landed it, not
    after the window (two phases) at a key nobody comes to: it fails here like any failed
    round (the work stays in the model, the peer re-syncs). A round not landed yet is left
    alone, and the records are read at most every ``LANDED_CHECK_S``."""

    monkeypatch.setattr(peer.round.joining, "LANDED_CHECK_S", 0.05)
    trainer, swarm = make_trainer(overlap=False)
    reads: list[float] = []
    holders = Agreement(trainer.state.round + (1 if landed else 0), "blake3:theirs", 3, 3)

    def accepted_state(**kwargs: Any) -> Agreement:
        if not searching.abandoned:  # (the failed round's re-sync reads them too)
            reads.append(time.monotonic())
            if len(reads) >= 20:  # a search not given up ends by its window (here: 20 reads)
                searching.abandoned = True
        return holders

    swarm.accepted_state = accepted_state  # type: ignore[method-assign, assignment]
    resyncs: list[int] = []
    trainer.catch_up = lambda: bool(resyncs.append(trainer.state.round))  # type: ignore[method-assign]
    searching = _Searching(meets=trainer.state.round)
    flight = trainer.launcher.launch(InnerPhase(time.monotonic(), math.inf, 2, 0, 0, done=2, samples=4, loss_sum=2.0))
    flight.pending = searching
    before = flatten(trainer.model)
    trainer._land(flight, wait=True)
    assert searching.abandoned
    assert (len(reads) == 1) == landed  # landed: given up at the first read
    assert all(b - a >= 0.05 - 1e-3 for a, b in zip(reads, reads[1:]))
    assert not trainer.history[-1].averaged
    assert torch.equal(flatten(trainer.model), before)  # the round's work stays in the model
    assert resyncs == ([0] if landed else [])  # the swarm moved on: re-sync


def _kept_update(trainer: Trainer, state: GlobalState, seed: int) -> Any:
    """The update a member kept of round ``state.round`` (one part of the whole vector, encoded
    once as a reducer does), and the state it made."""
    from peer.round.host_passes import roll_forward
    from peer.round.resync import outer_at
    from protocol.updates import FetchedUpdate

    codec = trainer.codec.at_round(state.round)
    numel = state.params.numel()
    average = torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * 1e-3
    buffer = codec.encode_unbiased(average, torch.rand(numel + 1024, generator=torch.Generator().manual_seed(seed)))
    update = FetchedUpdate(state.round, state.digest(), "", (), [(0, numel, buffer)], 0.0, "member")
    after = state.clone()
    roll_forward(after, update, outer_at(trainer.spec, state.round), trainer.codec)
    return replace(update, post=after.digest()), after


@pytest.mark.parametrize("forged", ["", "claim", "bytes"])
def test_a_newcomer_rolls_the_state_it_downloaded_forward_by_the_kept_updates(forged: str) -> None:
    """The swarm landed two rounds while the newcomer downloaded: it takes their updates, not a
    newer state, and adopts the state they make once the records agree on it. A hostile member's
    update is refused and nothing is adopted: one that does not make the state it claims, or
    other bytes that make the state they claim, which is not the swarm's."""
    spec = parse_spec(SPEC)
    task = build_task(spec, shard_seed=1)
    downloaded = GlobalState.from_model(task.model)
    downloaded = GlobalState(downloaded.params + 0.5, downloaded.momentum + 0.1, 3)

    class Swarm(RecordingSwarm):
        def __post_init__(self) -> None:
            super().__post_init__()
            self.downloads = 0
            self.updates: dict[int, Any] = {}
            self.latest = Agreement(3, downloaded.digest(), 3, 3)

        def accepted_state(self, **kwargs: Any) -> Agreement:
            return self.latest

        def download_state(self, accept: set[str], *, timeout: float, newer_than: int | None = None) -> Any:
            self.downloads += 1
            if self.downloads > 1:
                trainer.options.stop.set()
                return None
            self.latest = final  # the swarm landed two rounds meanwhile
            return (3, downloaded.params.clone(), downloaded.momentum.clone())

        def fallback_states(self, **kwargs: Any) -> list[Agreement]:
            return []

        def download_update(self, round_: int, digest: str, *, timeout: float) -> Any:
            update = self.updates.get(round_)
            return update if update is not None and update.pre == digest else None

    swarm = Swarm()
    journal = Journal()
    trainer = Trainer(spec, task, swarm, TrainerOptions(max_rounds=1), journal=journal)  # type: ignore[arg-type]
    first, after_first = _kept_update(trainer, downloaded, 1)
    second, after_second = _kept_update(trainer, after_first, 2)
    if forged == "claim":
        second = replace(second, post="blake3:" + "0" * 64)
    elif forged == "bytes":
        second, _ = _kept_update(trainer, after_first, 3)
    swarm.updates = {3: first, 4: second}
    final = Agreement(5, after_second.digest(), 3, 3)

    assert trainer.catch_up() is not bool(forged)
    assert swarm.downloads == (2 if forged else 1)
    if forged:
        assert trainer.state.round == 0  # nothing adopted
        assert journal.said == []  # nor a digest of a chain that ends off the swarm's given to a report
    else:
        assert trainer.state.round == 5 and trainer.state.digest() == after_second.digest()
        assert torch.equal(flatten(trainer.model), trainer.state.params)
        # every state the roll passed through is the swarm's: a report its last run left
        # unfinished for round 4 (killed while landing it) goes with round 4's digest
        assert journal.said == [
            ("holds", 3, downloaded.digest()),
            ("holds", 4, after_first.digest()),
            ("holds", 5, after_second.digest()),
        ]


def _joining_trainer(*, landed_ago: float, known: bool, lookup_s: float = 0.2) -> tuple[Trainer, list[int], float]:
    """A trainer that just adopted a state its members landed ``landed_ago`` seconds ago (their
    phase lasts the spec's 2 s budget); ``known``: it is in that state's roster."""
    spec = parse_spec(SPEC.replace("inner_steps = 2", "inner_steps = 1000\ntime_budget_s = 2.0"))
    stamp: dict[str, float] = {}

    class Swarm(RecordingSwarm):
        def seen_at(self, round_: int) -> float | None:
            return stamp["landed"] if round_ == 4 else None

        def lookup_s(self) -> float:
            return lookup_s  # its declaration takes about this long to be seen

    trainer = Trainer(spec, build_task(spec, shard_seed=1), Swarm(), TrainerOptions(max_rounds=1))  # type: ignore[arg-type]
    theirs = GlobalState(trainer.state.params + 0.25, trainer.state.momentum, 4)
    trainer.adoption.adopt(theirs, accepted={theirs.digest()})
    trainer.roster.known = known
    skipped: list[int] = []
    trainer.joining.next_round = lambda: skipped.append(trainer.state.round)  # type: ignore[method-assign]
    stamp["landed"] = time.monotonic() - landed_ago
    return trainer, skipped, stamp["landed"]


def test_a_peer_that_adopted_a_state_trains_until_its_members_launch_and_joins_with_that_work() -> None:
    """The members signed when they landed the state: their phase ends a budget later, and the
    newcomer's first phase ends ``JOIN_LEAD_S`` and two of its DHT lookups before that (its
    declaration must be seen when they launch), so its first round counts samples."""
    trainer, skipped, landed = _joining_trainer(landed_ago=0.0, known=False)
    inner = trainer.inner.open(ahead=False)
    assert inner.joining and inner.steps > 0 and not skipped
    assert inner.deadline == pytest.approx(landed + 2.0 - peer.round.joining.JOIN_LEAD_S - 2 * 0.2)  # 1.1 s ahead


def test_a_newcomer_too_late_for_the_round_of_its_state_joins_the_next_one() -> None:
    """Its members launched that round already: a search now would come after their group
    formed (and be given up), so it waits for them to land it and joins the next."""
    trainer, skipped, _ = _joining_trainer(landed_ago=2.5, known=False)
    inner = trainer.inner.open(ahead=False)
    assert skipped == [4] and inner.steps == 0


def test_a_member_back_in_its_roster_joins_the_round_at_once_however_late() -> None:
    """Its group made the state without it: that round's leader waits for it by name, so it
    searches at once (waiting for the next round cost the swarm the leader's whole window)."""
    trainer, skipped, _ = _joining_trainer(landed_ago=2.5, known=True)
    inner = trainer.inner.open(ahead=False)
    assert not skipped and inner.steps == 0 and not inner.joining


def test_a_peer_too_late_for_its_round_takes_that_rounds_update_as_soon_as_a_member_keeps_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It asks for the update (a round trip) rather than read the records until they show the
    round landed (a DHT lookup each, seconds on a home link), and reads the records once, to
    adopt the state the update makes only if they agree on it."""
    spec = parse_spec(SPEC.replace("inner_steps = 2", "inner_steps = 1000\ntime_budget_s = 2.0"))
    asks: list[float] = []
    reads: list[float] = []

    class Swarm(RecordingSwarm):
        update: Any = None
        agreed: Agreement | None = None

        def download_update(self, round_: int, digest: str, *, timeout: float) -> Any:
            asks.append(time.monotonic())
            if len(asks) < 3 or self.update is None or self.update.pre != digest:
                return None  # not kept yet: the members are landing the round
            update, self.update = self.update, None
            return update

        def accepted_state(self, **kwargs: Any) -> Agreement | None:
            reads.append(time.monotonic())
            return self.agreed

    monkeypatch.setattr(peer.round.joining, "LANDED_CHECK_S", 600.0)  # the records' own look, for runs keeping none
    swarm = Swarm()
    trainer = Trainer(spec, build_task(spec, shard_seed=1), swarm, TrainerOptions(max_rounds=1))  # type: ignore[arg-type]
    theirs = GlobalState(trainer.state.params + 0.25, trainer.state.momentum, 4)
    trainer.adoption.adopt(theirs, accepted={theirs.digest()})
    swarm.update, after = _kept_update(trainer, theirs, 7)
    swarm.agreed = Agreement(5, after.digest(), 3, 3)
    trainer.joining.next_round()
    assert trainer.state.round == 5 and trainer.state.digest() == after.digest()
    assert len(asks) >= 3
    assert len(reads) == 1  # once the update arrived: the records agree on what it makes

    # a forged update (the records agree on another state): nothing adopted
    swarm.update, forged = _kept_update(trainer, after, 8)
    swarm.agreed = Agreement(6, "blake3:" + "1" * 64, 3, 3)
    asks.clear()
    trainer.joining.next_round()
    assert trainer.state.round == 5 and trainer.state.digest() == after.digest()


def test_a_peer_that_adopted_a_state_late_in_the_members_phase_still_brings_one_step() -> None:
    """Its members launch before it could train to its lead: it takes one step anyway and
    joins with it, so the round it joins counts its work."""
    # the members launch in 1.25 s; its lead is 2.5 s (slow lookups)
    trainer, skipped, _ = _joining_trainer(landed_ago=0.75, known=False, lookup_s=1.0)
    inner = trainer.inner.open(ahead=False)
    assert inner.joining and not skipped
    assert not inner.over(trainer.options.stop)  # its deadline passed, its one step not taken
    trainer._train_step(inner)
    assert inner.over(trainer.options.stop) and inner.samples > 0


@pytest.mark.parametrize("deadline_s", [10.0, 15.0, 30.0])
def test_a_joining_round_declares_to_close_after_the_members_it_joins(deadline_s: float) -> None:
    """A peer that adopted the swarm's state launches a little before the members
    (``JOIN_LEAD_S``): declared with their window it expired first and led them, and a member
    that had not read its declaration yet led a group of its own (the round split, 11 s of an
    8 s phase in the lab). It declares to close ``FOLLOW_MARGIN_S`` after them, whatever the
    matchmaking deadline, and follows their leader (which waits for it as a declared peer)."""
    trainer, _, landed = _joining_trainer(landed_ago=0.5, known=False)
    trainer.timeouts = AdaptiveTimeouts(deadline_s, trainer.timeouts.allreduce_s)
    inner = trainer.inner.open(ahead=False)
    assert inner.joining
    flight = trainer.launcher.launch(inner)
    if flight.writing is not None:
        trainer.launcher.start_round(flight)
    (window,) = trainer.swarm.windows  # type: ignore[attr-defined]
    assert trainer.swarm.joinings == [True]  # type: ignore[attr-defined]
    declared_at = time.monotonic()
    launch = landed + trainer.spec.rounds.time_budget_s  # when the members launch, and declare
    members = matchmaking_window(trainer.matchmaking_timeout(trainer.local.phase_s or 0.0))
    assert declared_at + window >= launch + members + FOLLOW_MARGIN_S - 0.05


def test_a_search_for_a_window_is_the_shortest_that_declares_it() -> None:
    for window in (0.3, 1.0, 5.0, 9.0, 9.5, 16.0, 120.0):
        search = search_for_window(window)
        assert matchmaking_window(search) >= window
        assert matchmaking_window(search * 0.99) < window


def test_an_averaged_rows_in_sync_says_whether_its_round_counted_not_what_the_peer_is_later() -> None:
    """With the landing on its own thread, a round's row is written after the landing, and a
    peer whose round did not count (it started from another state than its group) may have
    re-synced by then (``in_sync`` True again). Its row then called its own stale landing "in
    sync": the churn lab counted the round as two states and the claim the coordinator denied as
    credit lost. The row says whether the round counted; a failed round's row says whether the
    peer is still in sync."""
    from concurrent.futures import Future

    from peer.round.launch import InFlight

    trainer, _swarm = make_trainer(overlap=True)
    done: Future[Any] = Future()
    done.set_result(None)
    flight = InFlight(
        pending=done,  # type: ignore[arg-type]
        compensated=True,
        samples=8,
        loss=1.0,
        compute_s=0.1,
        pre_digest="stale",
        launched_at=0.0,
        result=RoundResult(torch.zeros_like(trainer.state.params), 8, [], AllReduceStats(10, 10), 0.0),
    )
    trainer.in_sync = True  # it re-synced after the landing, before the row was written
    flight.counted = False
    assert not trainer.landing.round_metrics(flight, 3).in_sync
    flight.counted = True
    assert trainer.landing.round_metrics(flight, 3).in_sync
    failed = replace(flight, result=None, counted=False)
    assert trainer.landing.round_metrics(failed, 3).in_sync  # no result: the peer's own standing
