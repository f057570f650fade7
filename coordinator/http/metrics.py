"""Prometheus exposition of the swarm's figures (bounded label sets only).

One ``SwarmCollector`` is registered in one registry for the coordinator's life
(``metrics_registry``): every scrape reads the core and the store at that moment, and the
counters keep one ``_created`` time (the coordinator's start), so ``rate()`` and
``increase()`` work across scrapes. Counters are the raw totals (``_total``); rates are
Prometheus's to compute.

Per-peer families (``swarmtrain_peer_*``, label ``peer``: the first 20 characters of its
public id, the whole id where two online peers share them) cover only the peers online at
the scrape, so their label set stays as small as the swarm. Their figures are the peers'
own say-so (bounded by ``coordinator.limits``), kept in memory by the health tracker.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from coordinator.core import Coordinator
from coordinator.health import PeerHealth, network_paths

PEER_LABEL_CHARS = 20
"""Characters of a public id in the ``peer`` label (``ed25519:`` and 72 bits of the key)."""


class SwarmCollector(Collector):
    """The swarm's figures, read from ``core`` at each scrape (call it under the core's lock)."""

    def __init__(
        self,
        core: Coordinator,
        clock: Callable[[], float] = time.time,
        *,
        archive_round: Callable[[], tuple[int | None, float | None]] | None = None,
        started_at: float | None = None,
    ) -> None:
        self.core, self.clock = core, clock
        self.archive_round = archive_round
        """The newest archived round and when it was archived (None, None without an archive)."""
        self.started_at = clock() if started_at is None else started_at

    def collect(self) -> Iterator[Metric]:
        core, now = self.core, self.clock()
        snap = core.snapshot(now=now)
        latest = snap.latest
        yield _gauge("swarmtrain_peers_online", "Peers with a recent heartbeat", snap.peers_online)
        yield _gauge("swarmtrain_swarm_samples_per_second", "Sum of online peers' throughput", snap.samples_per_second)
        yield _gauge("swarmtrain_round", "Latest finalized round", snap.current_round)
        states = GaugeMetricFamily("swarmtrain_peers", "Peers by health state", labels=["state"])
        counts: dict[str, int] = {}
        for peer in snap.peers:
            counts[peer.state.value] = counts.get(peer.state.value, 0) + 1
        for state, count in sorted(counts.items()):
            states.add_metric([state], count)
        yield states
        yield _gauge(
            "swarmtrain_peers_flagged",
            "Peers their groups' robust averaging named in several of their recent claims",
            core.health.flagged(),
        )
        credited = core.store.credits_by_peer()
        yield self._counter(
            "swarmtrain_credited_samples", "Samples granted as credit", sum(c.samples for c in credited.values())
        )
        yield self._counter(
            "swarmtrain_credited_flops", "Compute granted as credit (FLOPs)", sum(c.flops for c in credited.values())
        )
        claims = CounterMetricFamily("swarmtrain_claims", "Round claims decided, by outcome", labels=["status"])
        decided = core.store.claim_counts()
        for status in ("granted", "denied"):
            claims.add_metric([status], decided.get(status, 0), created=self.started_at)
        yield claims
        yield _gauge("swarmtrain_claims_pending", "Round claims not decided yet", decided.get("pending", 0))
        if latest is not None:
            yield _gauge("swarmtrain_round_group_size", "Reports of the latest finalized round", latest.group_size)
            yield _gauge("swarmtrain_round_samples", "Samples granted in the latest finalized round", latest.samples)
            if latest.mean_loss is not None:
                yield _gauge("swarmtrain_round_loss", "Mean training loss its reporters stated", latest.mean_loss)
        yield from _round_view_families(core)
        evaluated = snap.evaluated
        if evaluated is not None and evaluated.validation_loss is not None:
            yield _gauge(
                "swarmtrain_validation_loss", "Validation loss of the latest evaluated round's state",
                evaluated.validation_loss,
            )  # fmt: skip
        data = snap.data
        if data is not None:
            yield self._counter(
                "swarmtrain_tokens_trained", "Tokens of granted samples (token runs)", data.tokens_trained
            )
            yield _gauge("swarmtrain_data_epoch", "The data order's position, in epochs", data.epoch)
            yield _gauge("swarmtrain_data_streams_held", "Data streams held by live peers", data.slots_held)
        if self.archive_round is not None:
            archived, at = self.archive_round()
            if archived is not None:
                yield _gauge("swarmtrain_archive_round", "Newest round in the coordinator's archive", archived)
            if at is not None:
                yield _gauge("swarmtrain_archive_age_seconds", "Seconds since the newest archived checkpoint", now - at)
        yield from self._peer_families(now)

    def _peer_families(self, now: float) -> Iterator[Metric]:
        core = self.core
        online = core.health.online(now)
        labels = _peer_labels(online)
        allreduce = GaugeMetricFamily(
            "swarmtrain_peer_allreduce_seconds",
            "Seconds the all-reduce of the peer's latest round took",
            labels=["peer"],
        )
        sent = CounterMetricFamily(
            "swarmtrain_peer_sent_bytes",
            "Bytes the peer sent in all-reduces, as its round reports said",
            labels=["peer"],
        )
        received = CounterMetricFamily(
            "swarmtrain_peer_received_bytes",
            "Bytes the peer received in all-reduces, as its round reports said",
            labels=["peer"],
        )
        failed = CounterMetricFamily(
            "swarmtrain_peer_failed_rounds",
            "Rounds whose averaging failed since the peer started, as its heartbeats said",
            labels=["peer"],
        )
        for peer in online:
            label = [labels[peer.key]]
            if peer.allreduce_s is not None:
                allreduce.add_metric(label, peer.allreduce_s)
            sent.add_metric(label, peer.bytes_sent, created=peer.counted_since)
            received.add_metric(label, peer.bytes_received, created=peer.counted_since)
            if peer.rounds_failed is not None:
                failed.add_metric(label, peer.rounds_failed)
        yield from (allreduce, sent, received, failed)
        paths = GaugeMetricFamily(
            "swarmtrain_peers_by_network_path",
            "Online peers by how others reach them (direct, announced, relayed, client; unknown: not said)",
            labels=["path"],
        )
        for path, count in network_paths(online).items():
            paths.add_metric([path], count)
        yield paths
        yield _gauge(
            "swarmtrain_hole_punched_connections",
            "Hole-punched connections between online peers, as their heartbeats count them (each at both ends)",
            sum(peer.punched_peers for peer in online),
        )
        yield _gauge(
            "swarmtrain_volunteer_relays",
            "Online peers that run a relay for peers nobody can dial (listed in join answers)",
            sum(1 for peer in online if peer.relay),
        )
        if core.relay_stats is not None:
            relay = core.relay_stats()
            yield _gauge("swarmtrain_relay_peers", "Peers holding a port on the coordinator's relay", relay.peers)
            yield _gauge("swarmtrain_relay_connections", "Connections the relay is splicing now", relay.connections)
            yield self._counter(
                "swarmtrain_relay_bytes", "Bytes the relay carried, both ways, since start", relay.bytes_relayed
            )
        yield self._counter(
            "swarmtrain_rounds_failed",
            "Rounds whose averaging failed, summed over the peers' heartbeats since the coordinator started",
            core.health.rounds_failed_total(),
        )
        yield _gauge(
            "swarmtrain_peers_out_of_sync",
            "Online peers whose latest state differs from the agreed digest of its round",
            len(core.out_of_sync(now)),
        )

    def _counter(self, name: str, documentation: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, documentation)
        family.add_metric([], value, created=self.started_at)
        return family


def _round_view_families(core: Coordinator) -> Iterator[Metric]:
    """How the latest decided round averaged (``coordinator.round_view``; no round label: one
    series each), and how many rounds of the window split."""
    view = core.round_view
    latest = view.latest_decided()
    if latest is not None:
        yield _gauge("swarmtrain_round_groups", "Averaging groups of the latest decided round", latest.groups)
        yield _gauge(
            "swarmtrain_round_states", "Distinct states its averaged peers landed in the latest decided round",
            latest.states,
        )  # fmt: skip
        yield _gauge(
            "swarmtrain_round_peers_averaged", "Peers that averaged in the latest decided round", latest.peers_averaged
        )
    yield _gauge(
        "swarmtrain_rounds_split",
        f"Rounds among the last {view.window} reported whose averaged peers landed more than one state",
        view.split_rounds(),
    )


def _peer_labels(peers: list[PeerHealth]) -> dict[str, str]:
    """Each peer's ``peer`` label: its id's first ``PEER_LABEL_CHARS`` characters, or the whole
    id where several of ``peers`` share them (no two series may have the same labels)."""
    short: dict[str, int] = {}
    for peer in peers:
        short[peer.key[:PEER_LABEL_CHARS]] = short.get(peer.key[:PEER_LABEL_CHARS], 0) + 1
    return {p.key: p.key[:PEER_LABEL_CHARS] if short[p.key[:PEER_LABEL_CHARS]] == 1 else p.key for p in peers}


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def metrics_registry(core: Coordinator, clock: Callable[[], float] = time.time, **kwargs: Any) -> CollectorRegistry:
    """The coordinator's one registry: ``SwarmCollector`` of ``core``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(core, clock, **kwargs))
    return registry


def render_metrics(core: Coordinator, *, now: float) -> str:
    """One exposition of ``core``'s figures at ``now`` (a registry of its own: tests, tools)."""
    return generate_latest(metrics_registry(core, lambda: now, started_at=now)).decode()
