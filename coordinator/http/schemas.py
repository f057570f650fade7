"""Response models of the coordinator's HTTP API: the OpenAPI document (``/openapi.json``) states
exactly what each endpoint returns, so clients (and ``schemathesis`` in the suite) can check it."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Healthz(BaseModel):
    ok: bool
    run: str


class DataProgress(BaseModel):
    tokens_trained: int = Field(ge=0, description="granted samples x sequence length")
    epoch: float = Field(ge=0, description="the data order's position, in epochs (as peers report it)")
    slots: int = Field(ge=1, description="the run's data streams (data.slots)")
    slots_held: int = Field(ge=0, description="streams held by live peers")


class RoundView(BaseModel):
    round: int = Field(ge=0, description="the round of the state its reporters landed")
    groups: int = Field(ge=0, description="distinct member sets of its reports naming two peers or more")
    states: int = Field(ge=0, description="distinct state digests of those reports (more than 1: the round split)")
    peers_averaged: int = Field(ge=0, description="distinct members of those groups, reported or not")
    reports: int = Field(ge=0, description="round reports received, groups of one included")
    decided: bool = Field(description="the coordinator decided the round's claims")


class Progress(BaseModel):
    tokens_per_sample: int | None = Field(None, ge=0)
    tokens_trained: int = Field(ge=0, description="granted samples x tokens per sample")
    tokens_per_second: float = Field(ge=0, description="the swarm's samples/s x tokens per sample")
    end: str = Field(description="what ends the run: tokens (schedule.total_tokens), rounds (max_rounds) or none")
    target: int | None = Field(None, description="the total tokens or the last round (None: no end)")
    fraction: float | None = Field(None, ge=0, le=1, description="how much of the run is done")
    eta_s: float | None = Field(
        None, ge=0, description="seconds to the end at the current pace (None: no end, or idle)"
    )


class Join(BaseModel):
    grpc_port: int = Field(ge=0, description="the coordinator's gRPC port (0: not known here)")
    coordinator_key: str = Field(description="the key peers pin with --coordinator-key")


class Status(BaseModel):
    run_name: str
    spec_digest: str
    current_round: int = Field(ge=0)
    current_state_digest: str
    peers_online: int = Field(ge=0)
    samples_per_second: float = Field(ge=0)
    last_checkpoint_round: int | None
    server_time: float
    validation_loss: float | None = Field(None, description="the latest round's validation loss, if any was evaluated")
    validation_round: int | None = None
    data: DataProgress | None = Field(None, description="token runs: progress through the data")
    rounds: list[RoundView] = Field(default_factory=list, description="the newest rounds reported, highest first")
    rounds_per_hour: float = Field(0.0, ge=0, description="rounds finalized per hour lately (0: idle)")
    progress: Progress | None = None
    join: Join | None = Field(None, description="what a volunteer joins with (the host is the one this page came from)")
    network_paths: dict[str, int] = Field(default_factory=dict, description="online peers by how others reach them")


class Checkpoint(BaseModel):
    round: int = Field(ge=0)
    state_digest: str
    size_bytes: int = Field(ge=0)
    archived_at: float
    file: str


class Checkpoints(BaseModel):
    enabled: bool
    every_rounds: int = Field(ge=0)
    checkpoints: list[Checkpoint]
    last_error: str


class ModelFile(BaseModel):
    name: str
    bytes: int = Field(ge=0)
    url: str = Field(description="where to download it (relative to the coordinator's HTTP root)")


class Model(BaseModel):
    round: int | None = Field(None, description="the archived round exported; None: no export yet")
    state_digest: str | None = None
    architecture: str | None = Field(None, description="the transformers model_type (gpt2 for the byte model)")
    parameters: int | None = None
    files: list[ModelFile] = Field(default_factory=list)
    last_error: str = ""


class PeerRow(BaseModel):
    key: str
    account: str | None
    libp2p_peer_id: str
    software_version: str
    reachable: bool
    network_path: str = ""
    """direct | announced | relayed | client | "" (not said)."""
    relay: bool = False
    """Whether it runs a relay for peers nobody can dial. Where is not published: only join
    answers name relays, to admitted peers (the peers API is open to anyone)."""
    punched_peers: int = Field(default=0, ge=0, description="peers it reaches over a hole-punched connection now")
    state: str = Field(description="online, stale, averaging, ... or offline (not heard from)")
    round: int | None
    samples_per_second: float = Field(ge=0)
    last_seen: float
    local_ranks: int = Field(ge=1)
    offences: int = Field(ge=0, description="claims denied because the peer's group named it (robust averaging)")
    flagged: bool = Field(description="named by its groups in several of its recent claims: a candidate for a ban")


class RoundRow(BaseModel):
    round: int = Field(ge=0)
    state_digest: str
    finalized_at: float
    group_size: int = Field(ge=0)
    mean_loss: float | None
    samples: int = Field(ge=0)
    validation_loss: float | None = Field(description="median validation loss its reporters published, if evaluated")
    states: int | None = Field(None, ge=0, description="distinct states its granted reporters landed (>1: split)")
    compute_s: float | None = Field(None, ge=0, description="inner steps (lower median of the granted reporters')")
    matchmaking_s: float | None = Field(None, ge=0, description="the wait for the group, less the all-reduce")
    allreduce_s: float | None = Field(None, ge=0, description="the all-reduce, group formed to result")
    landing_s: float | None = Field(None, ge=0, description="host work on the training thread: launch and landing")
    bytes_sent: float | None = Field(None, ge=0, description="bytes a reporter sent in the round")
    bytes_received: float | None = Field(None, ge=0, description="bytes a reporter received in the round")


class Contribution(BaseModel):
    samples: int = Field(ge=0)
    flops: float = Field(ge=0)
    rounds: int = Field(ge=0)


class AccountCredit(BaseModel):
    account_key: str
    samples: int = Field(ge=0)
    flops: float = Field(ge=0)
    peers: int = Field(ge=0)


class Credits(BaseModel):
    leaderboard: list[AccountCredit]
    by_peer: dict[str, Contribution]


class HistoryPoint(BaseModel):
    at: float
    peers_online: int = Field(ge=0)
    samples_per_second: float = Field(ge=0)
    rounds_failed: int = Field(0, ge=0, description="failed rounds summed over the peers since the coordinator started")
