"""An in-process swarm for training-quality sweeps: k real ``Trainer``s, one thread each, whose
rounds are averaged in memory by the same arithmetic the swarm's all-reduce does.

What is real: the trainer (inner phase, pseudo-gradient, error feedback, overlap's re-basing,
outer step, roster rule, validation), the task (model, data shards by ``shard_seed``), and the
reduction: every member's vector goes through the run's codec (``Codec.roundtrip``: what a
reducer decodes), each fragment (``engine.fragments``) is cut among the k reducers and into
parts of ``engine.allreduce.part_size_bytes`` as the butterfly cuts it, every part is reduced
by ``engine.robust.robust_mean`` under the spec's rule, and the average is encoded once,
unbiased, with a dither seeded by the round (``Codec.encode_unbiased``), as a reducer does.

What is not: no DHT, no matchmaking, no network. Every member is in every round's group, and
with overlap a round lands exactly ``delay_steps`` inner steps after the member launched it
(``LoopbackGroup(delay_steps=...)``): the real swarm lands it when the all-reduce is done, a
wall-clock time. That makes a run a pure function of its spec and seeds (see ``repeatable``
in ``benchmarks.training_quality``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.allreduce import part_size_bytes
from engine.codecs import get_codec
from engine.compression import Codec
from engine.fragments import fragment_bounds
from engine.outcome import AllReduceStats, FragmentDone
from engine.robust import Alignment, RobustRule, direction_offence, robust_mean
from peer.round.swarm_port import LentOutbox, RoundResult
from peer.task.base import derive_seed, generator
from protocol.gathered import Gathered
from protocol.roster import RosterClaim
from protocol.spec import AveragingSection


@dataclass
class RobustTally:
    """What robust averaging did to the members' parts over a run (they are all honest here)."""

    parts: int = 0
    clipped: int = 0
    left_out: int = 0
    weight_capped: int = 0
    named: int = 0
    dropped: int = 0
    """Member-rounds whose update was left out (``LoopbackGroup.drop``)."""

    def as_dict(self) -> dict[str, int]:
        return dict(vars(self))


def reducer_ranges(numel: int, members: int, codec: Codec, streams: int) -> list[slice]:
    """The parts a group of ``members`` reduces, as the butterfly cuts them: each fragment into
    parts of ``part_size_bytes`` from its start (whole blocks of the codec; hivemind then hands
    each reducer a contiguous run of whole parts, which changes no part's arithmetic)."""
    per_value = codec.bytes_per_value()
    parts: list[slice] = []
    for start, end in fragment_bounds(numel, streams):
        part_values = max(1, round(part_size_bytes(end - start, codec, members) / per_value))
        for p in range(start, end, part_values):
            parts.append(slice(p, min(end, p + part_values)))
    return parts


def reduce_group(
    vectors: list[torch.Tensor],
    weights: list[float],
    *,
    codec: Codec,
    rule: RobustRule,
    streams: int,
    seed: int,
    tally: RobustTally,
) -> torch.Tensor:
    """The group's average as every member receives it (the same tensor for all)."""
    numel = vectors[0].numel()
    sent = [codec.roundtrip(v) if codec.lossy else v for v in vectors]
    averaged = torch.empty(numel, dtype=torch.float32)
    dither = torch.rand(numel + codec.block, generator=generator(seed))
    alignment: dict[int, Alignment] = {}
    for part in reducer_ranges(numel, len(vectors), codec, streams):
        pieces = [s[part] for s in sent]
        reduced = robust_mean(pieces, weights, rule)
        tally.parts += len(pieces)
        tally.clipped += reduced.clipped
        tally.weight_capped += reduced.capped
        for index, seen in reduced.alignment.items():
            tally.left_out += seen.left_out
            alignment.setdefault(index, Alignment()).add(seen)
        mean = reduced.mean
        n = mean.numel()
        gathered = getattr(codec, "gathered", False)
        if gathered:
            # a gathered codec (``benchmarks.topk_reference``): every member averages the decoded
            # payloads itself, each value over the members that sent it (SparseLoCo's scatter
            # mean), and the average goes through no second encoding
            senders = sum((piece != 0).to(torch.float32) for piece in pieces)
            mean = mean * len(pieces) / torch.clamp(senders, min=1.0)
        encoded_once = codec.lossy and not gathered
        averaged[part] = (
            codec.decode(codec.encode_unbiased(mean, dither[: n + codec.block]), n) if encoded_once else mean
        )
    tally.named += sum(1 for seen in alignment.values() if direction_offence(seen, rule))
    return averaged


@dataclass
class LoopbackGroup:
    """The k members of one in-process swarm; every round's group is all of them."""

    members: int
    averaging: AveragingSection
    delay_steps: int = 0
    """With overlap: inner steps of the next phase before a launched round lands."""
    seed: int = 0
    drop: float = 0.0
    """Each member's update is left out of a round (weight 0, as the swarm weighs a stale or
    refused member: it still receives and lands the average) with this probability, drawn
    from the seed, round and member; one member always counts. DiLoCo's dropped outer
    gradients (arXiv 2311.08105 Fig. 8); the rounds a late joiner's or a split-off peer's
    work does not count."""
    tally: RobustTally = field(default_factory=RobustTally)
    _lock: threading.Condition = field(default_factory=threading.Condition)
    _launched: dict[int, dict[int, tuple[torch.Tensor, float, Gathered]]] = field(default_factory=dict)
    _results: dict[int, list[Gathered]] = field(default_factory=dict)
    _closed: bool = False
    _begun: dict[int, dict[int, tuple[float, Gathered]]] = field(default_factory=dict)
    """Fragments in turn: each round's members' weights and statements, as they launched it."""
    _opened: dict[tuple[int, int], dict[int, torch.Tensor]] = field(default_factory=dict)
    _reduced: set[tuple[int, int]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.codec = get_codec(self.averaging.compression, self.averaging.density, self.averaging.bits)
        self.rule = RobustRule.for_spec(self.averaging)

    def launch(self, index: int, round_: int, vector: torch.Tensor, weight: float, gather: Gathered) -> None:
        with self._lock:
            launched = self._launched.setdefault(round_, {})
            if index in launched:
                raise RuntimeError(f"member {index} launched round {round_} twice")
            launched[index] = (vector, weight, gather)
            if len(launched) < self.members:
                return
            order = sorted(launched)
            averaged = reduce_group(
                [launched[i][0] for i in order],
                self._weights(round_, [launched[i][1] for i in order]),
                codec=self.codec.at_round(round_),
                rule=self.rule,
                streams=self.averaging.streams,
                seed=derive_seed(self.seed, "loopback-dither", round_),
                tally=self.tally,
            )
            for i in order:
                launched[i][0].copy_(averaged)
            self._results[round_] = [launched[i][2] for i in order]
            del self._launched[round_]
            self._lock.notify_all()

    def begin(self, index: int, round_: int, weight: float, gather: Gathered) -> None:
        """Fragments in turn: member ``index`` launched ``round_`` (its fragments come one by one)."""
        with self._lock:
            begun = self._begun.setdefault(round_, {})
            if index in begun:
                raise RuntimeError(f"member {index} launched round {round_} twice")
            begun[index] = (weight, gather)

    def open_fragment(self, index: int, round_: int, fragment: int, values: torch.Tensor) -> None:
        """Member ``index`` wrote fragment ``fragment`` of ``round_`` into ``values``: once every
        member has, the group's average of it replaces each member's values (as one all-reduce
        of that fragment does, its dither the round's and the fragment's)."""
        with self._lock:
            opened = self._opened.setdefault((round_, fragment), {})
            opened[index] = values
            if len(opened) < self.members or len(self._begun.get(round_, {})) < self.members:
                return
            order = sorted(opened)
            begun = self._begun[round_]
            averaged = reduce_group(
                [opened[i] for i in order],
                self._weights(round_, [begun[i][0] for i in order]),
                codec=self.codec.at_round(round_),
                rule=self.rule,
                streams=self.averaging.streams,
                seed=derive_seed(self.seed, "loopback-dither", round_, fragment),
                tally=self.tally,
            )
            for i in order:
                opened[i].copy_(averaged)
            del self._opened[(round_, fragment)]
            self._reduced.add((round_, fragment))
            self._results[round_] = [begun[i][1] for i in order]
            self._lock.notify_all()

    def wait_fragment(self, round_: int, fragment: int) -> bool:
        """Whether fragment ``fragment`` of ``round_`` was reduced (waiting for it; False if the group closed first)."""
        with self._lock:
            while (round_, fragment) not in self._reduced and not self._closed:
                self._lock.wait(timeout=1.0)
            return (round_, fragment) in self._reduced

    def _weights(self, round_: int, weights: list[float]) -> list[float]:
        """The members' weights in ``round_`` with the dropped ones at 0 (``drop``)."""
        if not self.drop:
            return weights
        draws = [
            torch.rand(1, generator=generator(derive_seed(self.seed, "drop", round_, i))).item()
            for i in range(len(weights))
        ]
        kept = [w if draw >= self.drop else 0.0 for w, draw in zip(weights, draws)]
        if not any(kept):
            best = max(range(len(draws)), key=draws.__getitem__)
            kept[best] = weights[best]
        self.tally.dropped += sum(1 for w in kept if not w)
        return kept

    def wait(self, round_: int) -> list[Gathered] | None:
        """What the round's members gathered, once it is reduced; None if the group closed first."""
        with self._lock:
            while round_ not in self._results and not self._closed:
                self._lock.wait(timeout=1.0)
            return self._results.get(round_)

    def close(self) -> None:
        """Release members waiting for a round that will never be complete (one failed)."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()


@dataclass
class _FragmentAnswer:
    """Fragment ``fragment`` of a round averaged in turn: done once ``delay_steps`` inner steps
    passed since it was written and the group reduced it (``done`` then waits for that)."""

    swarm: LoopbackSwarm
    round_: int
    fragment: int
    opened_at_step: int

    def done(self) -> bool:
        if self.swarm.steps() - self.opened_at_step < self.swarm.group.delay_steps:
            return False
        self.swarm.group.wait_fragment(self.round_, self.fragment)
        return True

    def result(self, timeout: float | None = None) -> FragmentDone:
        start, end = self.swarm.bounds[self.fragment]
        if not self.swarm.group.wait_fragment(self.round_, self.fragment):
            return FragmentDone(self.fragment, start, end, failed="the loopback group closed")
        members = None
        if self.fragment == 0:
            gathered = self.swarm.group.wait(self.round_) or []
            members = {f"member{i}": data for i, data in enumerate(gathered)}
        return FragmentDone(self.fragment, start, end, members=members)


@dataclass
class _Pending:
    """A round launched by one member: done once ``delay_steps`` inner steps passed since the
    launch and the whole group launched (``done`` then waits for the reduction, so where a
    round lands never depends on thread timing)."""

    swarm: LoopbackSwarm
    round_: int
    launched_at_step: int

    @property
    def meets(self) -> int:
        return self.round_

    def wait(self, timeout: float) -> bool:
        return True  # ``result`` blocks until the group's reduction (never a real wait)

    def abandon(self) -> bool:
        return False  # every member of the loopback group is in its round

    def done(self) -> bool:
        if self.swarm.in_turn:  # asked once every fragment is answered
            return True
        if self.swarm.steps() - self.launched_at_step < self.swarm.group.delay_steps:
            return False
        self.result()
        return True

    def open_fragment(self, index: int) -> _FragmentAnswer:
        start, end = self.swarm.bounds[index]
        answer = _FragmentAnswer(self.swarm, self.round_, index, self.swarm.steps())
        self.swarm.group.open_fragment(self.swarm.index, self.round_, index, self.swarm.vector[: end - start])
        return answer

    def result(self) -> RoundResult | None:
        members = self.swarm.group.wait(self.round_)
        if members is None:
            return None
        return RoundResult(
            averaged=self.swarm.vector,
            group_size=len(members),
            members=members,
            stats=AllReduceStats(),
            wait_s=0.0,
        )


class LoopbackSwarm:
    """Member ``index`` of a ``LoopbackGroup``: the ``peer.round.swarm_port.SwarmPort`` a trainer uses."""

    def __init__(self, group: LoopbackGroup, index: int, numel: int) -> None:
        self.group, self.index = group, index
        self.vector = torch.zeros(numel, dtype=torch.float32)
        self.steps: Callable[[], int] = lambda: 0
        """The member trainer's inner steps so far (set once the trainer exists)."""
        self.ids: set[str] = set()
        averaging = group.averaging
        self.bounds = fragment_bounds(numel, averaging.fragments_in_turn)
        self.in_turn = len(self.bounds) > 1
        """Fragments in turn: rounds start with ``LoopbackGroup.begin``, fragments open one by one."""

    @contextmanager
    def outbox(self) -> Iterator[torch.Tensor]:
        yield self.vector

    def lend_outbox(self) -> LentOutbox | None:
        """The vector, for the inner steps' gradients (``peer.round.grad_home``)."""
        return LentOutbox(self.vector, lambda: None)

    def start_round(
        self,
        *,
        weight: float,
        gather: Gathered,
        timeout: float | None = None,
        window: float | None = None,
        joining: bool = False,
    ) -> _Pending:
        assert gather.round is not None, "a trainer states the round it launches"
        pending = _Pending(self, gather.round, self.steps())
        if self.in_turn:
            self.group.begin(self.index, gather.round, weight, gather)
        else:
            self.group.launch(self.index, gather.round, self.vector, weight, gather)
        return pending

    def fragment_buffer(self) -> torch.Tensor:
        return self.vector

    def set_sync_span(self, span_s: float) -> None:
        pass

    def set_allreduce_timeout(self, timeout_s: float) -> None:
        pass

    def saw_group(self, members: list[Gathered]) -> None:
        pass

    def publish_digest(
        self,
        identity: Any,
        *,
        round_: int,
        digest: str,
        roster: int = 0,
        leaving: bool = False,
        landed: float | None = None,
    ) -> None:
        pass

    def roster_of(self, digest: str, *, exclude: Any = None) -> RosterClaim:
        return RosterClaim(self.group.members, frozenset())

    def behind(self, round_: int) -> bool:
        return False

    def accepted_state(self, *, exclude: Any = None) -> None:
        return None

    def fallback_states(self, *, exclude: Any = None, after_round: int = -1) -> list[Any]:
        return []

    def peers_at(self, round_: int, *, exclude: Any = None) -> set[str]:
        return {f"member{i}" for i in range(self.group.members) if i != self.index}

    def landed_beside(self, round_: int, group: frozenset[str], *, within_s: float) -> frozenset[str]:
        return frozenset()  # the loopback group is the whole swarm: nobody lands beside it

    def serve_state(self, provider: Any) -> None:
        pass

    def lookup_s(self) -> float:
        return 0.0

    def prefetch_records(self) -> None:
        pass

    def seen_at(self, round_: int) -> float | None:
        return None

    def download_state(self, accept: set[str], *, timeout: float, newer_than: int | None = None) -> None:
        return None

    def keep_update(self, round_: int, pre: str, post: str, left_out: list[tuple[int, int]]) -> None:
        pass

    def download_update(self, round_: int, digest: str, *, timeout: float) -> None:
        return None
