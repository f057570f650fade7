"""The coordinator database's tables, as typed SQLAlchemy 2 ORM classes.

Only integer, float and text columns, so the same schema runs on SQLite and PostgreSQL.
Times are Unix seconds (float) passed in by the caller. Bump ``SCHEMA_VERSION`` whenever a
table changes; ``Store`` refuses a database written under another version.
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Float, ForeignKey, Index, Integer, Text, UniqueConstraint
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

SCHEMA_VERSION = 3
"""The layout written by this code; recorded in ``schema_version`` on creation. Version 2
added ``rounds.validation_loss`` and the ``data_slots`` table, version 3 the rounds' states
and time split and ``swarm_samples.rounds_failed`` (``engine`` migrates an older database in
place)."""

PENDING, GRANTED, DENIED = "pending", "granted", "denied"
"""The values of ``claims.status``."""


class Base(DeclarativeBase):
    """Declarative base; ``Base.metadata`` holds every table below."""


class SchemaVersion(Base):
    """One row per schema version this database was created with (today: exactly one)."""

    __tablename__ = "schema_version"
    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    applied_at: Mapped[float] = mapped_column(Float)


class Run(Base):
    """The single run this coordinator serves (``id`` is always 1)."""

    __tablename__ = "run"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    spec_digest: Mapped[str] = mapped_column(Text)
    spec_toml: Mapped[str] = mapped_column(Text)
    name: Mapped[str] = mapped_column(Text)


class Allowed(Base):
    """An account key admitted when the run's admission mode is an allowlist."""

    __tablename__ = "allowlist"
    account_key: Mapped[str] = mapped_column(Text, primary_key=True)


class Ban(Base):
    """A banned peer key, with the reason a person can read."""

    __tablename__ = "bans"
    peer_key: Mapped[str] = mapped_column(Text, primary_key=True)
    reason: Mapped[str] = mapped_column(Text)
    banned_at: Mapped[float] = mapped_column(Float)


class Peer(Base):
    """A peer that joined at least once; ``reachable`` is 0 or 1."""

    __tablename__ = "peers"
    key: Mapped[str] = mapped_column(Text, primary_key=True)
    account_key: Mapped[str | None] = mapped_column(Text, nullable=True, index=True)
    libp2p_peer_id: Mapped[str] = mapped_column(Text)
    software_version: Mapped[str] = mapped_column(Text)
    hardware_json: Mapped[str] = mapped_column(Text)
    reachable: Mapped[int] = mapped_column(Integer)
    first_seen: Mapped[float] = mapped_column(Float)
    last_seen: Mapped[float] = mapped_column(Float)


class Claim(Base):
    """A peer's claim of work for one round; at most one per (key, round)."""

    __tablename__ = "claims"
    __table_args__ = (
        UniqueConstraint("key", "round", name="uq_claims_key_round"),
        Index("ix_claims_status", "status"),
        Index("ix_claims_round", "round"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    key: Mapped[str] = mapped_column(Text)
    round: Mapped[int] = mapped_column(Integer)
    samples: Mapped[int] = mapped_column(BigInteger)
    group_json: Mapped[str] = mapped_column(Text)
    state_digest: Mapped[str] = mapped_column(Text)
    duration_s: Mapped[float] = mapped_column(Float)
    received_at: Mapped[float] = mapped_column(Float)
    status: Mapped[str] = mapped_column(Text, default=PENDING)
    granted_samples: Mapped[int] = mapped_column(BigInteger, default=0)
    flops: Mapped[float] = mapped_column(Float, default=0.0)
    reason: Mapped[str] = mapped_column(Text, default="")
    decided_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class Credit(Base):
    """One granted claim in the append-only ledger; at most one per claim and per (key, round)."""

    __tablename__ = "credits"
    __table_args__ = (UniqueConstraint("key", "round", name="uq_credits_key_round"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    claim_id: Mapped[int] = mapped_column(Integer, ForeignKey("claims.id"), unique=True)
    key: Mapped[str] = mapped_column(Text)
    round: Mapped[int] = mapped_column(Integer)
    samples: Mapped[int] = mapped_column(BigInteger)
    flops: Mapped[float] = mapped_column(Float)
    granted_at: Mapped[float] = mapped_column(Float)


class RoundRecord(Base):
    """A finalized averaging round of the swarm (one row per round, last write wins)."""

    __tablename__ = "rounds"
    round: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    state_digest: Mapped[str] = mapped_column(Text)
    finalized_at: Mapped[float] = mapped_column(Float)
    group_size: Mapped[int] = mapped_column(Integer)
    mean_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    samples: Mapped[int] = mapped_column(BigInteger)
    validation_loss: Mapped[float | None] = mapped_column(Float, nullable=True)
    """Median of the validation losses the round's granted reporters published (eval.every_rounds)."""
    states: Mapped[int | None] = mapped_column(Integer, nullable=True)
    """Distinct state digests of the round's granted claims (more than 1: it split)."""
    compute_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    """This and the five below: lower medians of what the granted reporters said (``RoundTiming``)."""
    matchmaking_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    allreduce_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    landing_s: Mapped[float | None] = mapped_column(Float, nullable=True)
    bytes_sent: Mapped[float | None] = mapped_column(Float, nullable=True)
    bytes_received: Mapped[float | None] = mapped_column(Float, nullable=True)


class DataSlot(Base):
    """A data stream of a token run and the peer holding it (``coordinator.slots``)."""

    __tablename__ = "data_slots"
    slot: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    peer_key: Mapped[str] = mapped_column(Text, index=True)
    assigned_at: Mapped[float] = mapped_column(Float)


class SwarmSample(Base):
    """One point of the swarm's time series (dashboard charts); pruned by age."""

    __tablename__ = "swarm_samples"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float, index=True)
    peers_online: Mapped[int] = mapped_column(Integer)
    samples_per_second: Mapped[float] = mapped_column(Float)
    rounds_failed: Mapped[int] = mapped_column(Integer, default=0)
