"""Prometheus text exposition of the swarm's figures (bounded label sets only)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from coordinator.core import Coordinator


def render_metrics(core: Coordinator, *, now: float) -> str:
    """A fresh registry per scrape: every value is read from the core and the store now."""
    registry = CollectorRegistry()
    summary = core.health.summary(now)
    rounds = core.store.rounds(limit=1)
    Gauge("swarmtrain_peers_online", "Peers with a recent heartbeat", registry=registry).set(summary.peers_online)
    Gauge("swarmtrain_swarm_samples_per_second", "Sum of online peers' throughput", registry=registry).set(
        summary.samples_per_second
    )
    Gauge("swarmtrain_round", "Latest finalized round", registry=registry).set(rounds[0]["round"] if rounds else 0)
    states = Gauge("swarmtrain_peers", "Peers by health state", ["state"], registry=registry)
    for peer in core.health.peers():
        states.labels(state=peer.state.value).inc()
    Gauge(
        "swarmtrain_peers_flagged",
        "Peers their groups' robust averaging named in several of their recent claims",
        registry=registry,
    ).set(core.health.flagged())
    credited = core.store.credits_by_peer()
    Counter("swarmtrain_credited_samples", "Samples granted as credit", registry=registry).inc(
        sum(c["samples"] for c in credited.values())
    )
    Counter("swarmtrain_credited_flops", "Compute granted as credit (FLOPs)", registry=registry).inc(
        sum(c["flops"] for c in credited.values())
    )
    evaluated = core.store.latest_validation()
    if evaluated is not None:
        Gauge(
            "swarmtrain_validation_loss", "Validation loss of the latest evaluated round's state", registry=registry
        ).set(evaluated["validation_loss"])
    data = core.data_progress()
    if data is not None:
        Counter("swarmtrain_tokens_trained", "Tokens of granted samples (token runs)", registry=registry).inc(
            data["tokens_trained"]
        )
        Gauge("swarmtrain_data_epoch", "The data order's position, in epochs", registry=registry).set(data["epoch"])
    return generate_latest(registry).decode()
