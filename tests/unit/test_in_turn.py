"""Fragments in turn (``averaging.sync_fragments``, ``peer.round.in_turn``): a trainer writes its
round's fragments one at a time as its next inner phase goes on, and lands each on its range
as soon as its average is in. Landing them one by one must give exactly the bits one landing of
the whole vector gives (the same Δ sent, θ_g, momentum, codec residual, and each range of the
model re-based by its own fragment's progress), on the compiled path and the reference alike."""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from engine.compression import KERNELS_ENV, compiled_kernels
from engine.fragments import fragment_bounds
from engine.outcome import FragmentDone
from peer.round.host_passes import land_global, write_delta_from
from peer.round.inner import InnerPhase
from peer.round.resync import outer_at
from peer.round.state import GlobalState, flatten
from peer.round.trainer import Trainer, TrainerOptions
from peer.task import build_task
from protocol.gathered import Gathered
from protocol.spec import RunSpec, parse_spec
from tests.specs import bare_spec
from tests.unit.recording_swarm import RecordingSwarm

IN_TURN = 3


def in_turn_spec(codec: str, in_turn: int = IN_TURN) -> RunSpec:
    return parse_spec(
        bare_spec(
            "inturn",
            d_model=96,
            n_layers=2,
            context=8,
            batch_size=2,
            inner_steps=6,
            compression=codec,
            overlap=True,
            sections={"averaging": {"sync_fragments": in_turn}},
        )  # fmt: skip
    )


@dataclass
class _Answer:
    done_value: FragmentDone | None = None

    def done(self) -> bool:
        return self.done_value is not None

    def result(self, timeout: float | None = None) -> FragmentDone:
        if self.done_value is None:
            raise TimeoutError
        return self.done_value


@dataclass
class _FragmentRound:
    """A round averaged in turn, answered by hand: ``answer(i, average)`` writes the fragment's
    average into the buffer, as the averager does, and answers its gate."""

    buffer: torch.Tensor
    bounds: list[tuple[int, int]]
    sent: dict[int, torch.Tensor] = field(default_factory=dict)
    answers: dict[int, _Answer] = field(default_factory=dict)
    meets: int = 0
    finished: bool = False

    auto: torch.Tensor | None = None
    """Answer every fragment with this average as soon as it is opened."""

    def open_fragment(self, index: int) -> _Answer:
        start, end = self.bounds[index]
        self.sent[index] = self.buffer[: end - start].clone()
        self.answers[index] = _Answer()
        if self.auto is not None:
            self.answer(index, self.auto)
        return self.answers[index]

    def answer(self, index: int, average: torch.Tensor) -> None:
        start, end = self.bounds[index]
        self.buffer[: end - start].copy_(average[start:end])
        members: dict[str, Gathered | None] | None = {} if index == 0 else None
        self.answers[index].done_value = FragmentDone(index, start, end, members=members)
        self.finished = index == len(self.bounds) - 1

    def done(self) -> bool:
        return self.finished

    def wait(self, timeout: float) -> bool:
        return True

    def abandon(self) -> bool:
        return False

    def result(self) -> Any:
        from engine.outcome import AllReduceStats
        from peer.round.swarm_port import RoundResult

        return RoundResult(self.buffer, 2, [], AllReduceStats(10, 10), 0.0)


class InTurnSwarm(RecordingSwarm):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.round: _FragmentRound | None = None
        self.spans: list[float] = []

    def use(self, numel: int, in_turn: int) -> None:
        bounds = fragment_bounds(numel, in_turn)
        self.buffer = torch.full((max(e - s for s, e in bounds),), float("nan"))
        self.bounds = bounds

    def fragment_buffer(self) -> torch.Tensor:
        return self.buffer

    def set_sync_span(self, span_s: float) -> None:
        self.spans.append(span_s)

    def start_round(self, **kwargs: Any) -> _FragmentRound:  # type: ignore[override]
        self.round = _FragmentRound(self.buffer, self.bounds, auto=self.auto)
        return self.round

    auto: torch.Tensor | None = None


@contextmanager
def kernels(on: bool, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv(KERNELS_ENV, "on" if on else "off")
    compiled_kernels.cache_clear()
    try:
        yield
    finally:
        compiled_kernels.cache_clear()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "reference"])
@pytest.mark.parametrize("codec", ["fp16", "int8", "4bit", "sparse"])
def test_fragments_landed_in_turn_are_the_bits_of_one_landing_of_the_whole_vector(
    codec: str, compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    spec = in_turn_spec(codec)
    swarm = InTurnSwarm()
    with kernels(compiled, monkeypatch):
        trainer = Trainer(spec, build_task(spec, shard_seed=1), swarm, TrainerOptions(max_rounds=3))  # type: ignore[arg-type]
        numel = trainer.state.params.numel()
        swarm.use(numel, IN_TURN)
        bounds = fragment_bounds(numel, IN_TURN)
        assert len(bounds) == IN_TURN and trainer.local.launch_point is None  # no model-sized launch point
        generator = torch.Generator().manual_seed(7)
        assert trainer.feedback is not None
        trainer.feedback.load_residual(1e-4 * torch.randn(numel, generator=generator))
        theta = GlobalState(trainer.state.params.clone(), trainer.state.momentum.clone(), 0)
        residual = trainer.feedback.residual
        with torch.no_grad():  # the inner phase's progress
            for p in trainer.model.parameters():
                p.add_(1e-2 * torch.randn(p.shape, generator=generator))
        launch = torch.empty(numel)
        before_landing = torch.empty(numel)
        after_landing = torch.empty(numel)
        average = 1e-3 * torch.randn(numel, generator=generator)

        snapshot = flatten(trainer.model)
        flight = trainer.launcher.launch(
            InnerPhase(time.monotonic(), math.inf, 6, 0, 0, done=6, samples=4, loss_sum=6.0)
        )
        assert flight.turn is not None and swarm.round is not None and sorted(swarm.round.sent) == [0]
        launch[slice(*bounds[0])] = snapshot[slice(*bounds[0])]
        phase = InnerPhase(time.monotonic(), math.inf, 6, 1, 1)  # the next inner phase
        for index in range(IN_TURN):
            with torch.no_grad():  # inner steps while the fragment averages
                for p in trainer.model.parameters():
                    p.mul_(1.001)
            trainer.in_turn.advance(flight, phase, wait=False)
            assert sorted(swarm.round.sent) == list(range(index + 1))  # not due before its share of the phase
            snapshot = flatten(trainer.model)
            swarm.round.answer(index, average)
            before_landing[slice(*bounds[index])] = snapshot[slice(*bounds[index])]
            phase.done = 2 * (index + 1)  # its share of the phase: the next fragment is due
            if index + 1 < IN_TURN:
                trainer.in_turn.advance(flight, phase, wait=False)  # lands it, writes the next
                assert sorted(swarm.round.sent) == list(range(index + 2))
                launch[slice(*bounds[index + 1])] = snapshot[slice(*bounds[index + 1])]
                assert trainer.state.round == 0 and trainer.local.between_rounds
                with pytest.raises(RuntimeError, match="between two rounds"):  # served to nobody meanwhile
                    trainer._serve(lambda *args: {})
            else:
                assert trainer._land(flight, wait=True)
            after_landing[slice(*bounds[index])] = flatten(trainer.model)[slice(*bounds[index])]
        assert trainer.state.round == 1 and not trainer.local.between_rounds

        # the reference: one landing of the whole vector from the same launch points
        sent = torch.cat([swarm.round.sent[i] for i in range(IN_TURN)])
        feedback = type(trainer.feedback)(trainer.feedback.codec, numel)
        feedback.load_residual(residual)
        expected_sent = torch.empty(numel)
        write_delta_from(launch, theta.params, expected_sent, feedback=feedback)
        assert torch.equal(sent.view(torch.int32), expected_sent.view(torch.int32))
        shift = launch.clone()
        land_global(
            theta, average, outer_at(spec, 0), feedback=feedback, launch_point=shift, codec=trainer.codec.at_round(0)
        )
    for what, got, want in (
        ("θ_g", trainer.state.params, theta.params),
        ("momentum", trainer.state.momentum, theta.momentum),
        ("residual", trainer.feedback.residual, feedback.residual),
        ("model", after_landing, before_landing + shift),  # each range re-based by its own progress
    ):
        differ = (got.view(torch.int32) != want.view(torch.int32)).nonzero()
        per = [int(((got - want)[a:b] != 0).sum()) for a, b in bounds]
        assert not differ.numel(), (what, per, float((got - want).abs().max()), bounds)
    assert swarm.spans  # the averager was told how far apart members may write a fragment


def test_a_round_that_finds_no_group_lands_nothing_and_its_work_folds_into_the_next() -> None:
    spec = in_turn_spec("int8")
    swarm = InTurnSwarm()
    trainer = Trainer(spec, build_task(spec, shard_seed=1), swarm, TrainerOptions(max_rounds=3))  # type: ignore[arg-type]
    swarm.use(trainer.state.params.numel(), IN_TURN)
    before = trainer.state.digest()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(0.01)
    model = flatten(trainer.model)
    flight = trainer.launcher.launch(InnerPhase(time.monotonic(), math.inf, 6, 0, 0, done=6, samples=4, loss_sum=6.0))
    assert swarm.round is not None
    swarm.round.answers[0].done_value = FragmentDone(0, *swarm.bounds[0], failed="the round found no group here")
    swarm.round.finished = True
    swarm.round.result = lambda: None  # type: ignore[method-assign]
    assert trainer._land(flight, wait=True)
    assert sorted(swarm.round.sent) == [0]  # nothing after a fragment the averager did not take
    assert trainer.state.digest() == before and trainer.in_sync
    assert torch.equal(flatten(trainer.model), model)  # the work is still in the model
    assert trainer.local.unlanded[0] == 4 and not trainer.local.between_rounds
    assert trainer.history[-1].failure


def test_the_spec_refuses_fragments_in_turn_without_overlap_or_with_an_eager_start() -> None:
    from protocol.spec import ConfigError

    with pytest.raises(ConfigError, match="overlap = true"):
        parse_spec(bare_spec("x", overlap=False, sections={"averaging": {"sync_fragments": 2}}))
    with pytest.raises(ConfigError, match="overlap_start"):
        parse_spec(
            bare_spec("x", overlap=True, sections={"averaging": {"sync_fragments": 2, "overlap_start": '"eager"'}})
        )


def test_a_peer_that_does_not_overlap_sends_every_fragment_in_turn_at_its_phases_end() -> None:
    """``--no-overlap`` against a spec of fragments in turn: every member must cut its vector as
    the spec says, so the fragments still go one by one, all at the phase's end; the gradients
    never live in the averager's vector (one fragment long)."""
    spec = in_turn_spec("int8")
    swarm = InTurnSwarm()
    trainer = Trainer(spec, build_task(spec, shard_seed=1), swarm, TrainerOptions(max_rounds=1, overlap=False))  # type: ignore[arg-type]
    numel = trainer.state.params.numel()
    swarm.use(numel, IN_TURN)
    swarm.auto = torch.full((numel,), 1e-3)
    assert not trainer.inner.grads.enabled and trainer.local.launch_point is None
    history = trainer.run()
    assert swarm.round is not None and sorted(swarm.round.sent) == list(range(IN_TURN))
    assert trainer.state.round == 1 and history[-1].averaged and trainer.in_sync


def test_a_vector_too_short_for_two_fragments_is_averaged_whole_as_the_averager_cuts_it() -> None:
    """The trainer and its averager cut alike (``engine.fragments``): a model under two
    fragments' worth of values is one fragment, so no gate is waited for and the round is plain
    overlap (the averager would never answer a gate it does not have)."""
    from engine.fragment_rounds import sync_layout

    spec = parse_spec(
        bare_spec("small", overlap=True, compression="int8", sections={"averaging": {"sync_fragments": 4}})
    )
    trainer = Trainer(spec, build_task(spec, shard_seed=1), RecordingSwarm(), TrainerOptions(max_rounds=1))  # type: ignore[arg-type]
    numel = trainer.state.params.numel()
    syncs, _ = sync_layout(numel, 4, spec.averaging.streams)
    assert len(syncs) == 1 and trainer.in_turn.fragments == 1
    assert trainer.launcher.in_turn is None and trainer.local.launch_point is not None
