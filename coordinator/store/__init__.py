"""The coordinator's persistence: SQLAlchemy 2, SQLite by default, any SQLAlchemy URL.

``Store`` (in ``store.py``) is the API the coordinator uses and ``rows.py`` what its
round-path queries return, ``claims.py`` what a claim and its verdict are, ``reports.py`` what a burst of reports writes and reads many at a time; ``schema.py`` holds the tables, ``engine.py`` opens a database (pragmas, schema creation, ``ConfigError``s).
"""

from coordinator.store.claims import ClaimStatus, ClaimVerdict, RoundClaim
from coordinator.store.engine import sqlite_url
from coordinator.store.rows import ClaimRow, CreditTotals, NewClaim, PeerCredit, PeerRow, RoundRow, RoundTiming
from coordinator.store.schema import SCHEMA_VERSION
from coordinator.store.store import Store

__all__ = [
    "SCHEMA_VERSION",
    "ClaimRow",
    "ClaimStatus",
    "ClaimVerdict",
    "CreditTotals",
    "NewClaim",
    "PeerCredit",
    "PeerRow",
    "RoundClaim",
    "RoundRow",
    "RoundTiming",
    "Store",
    "sqlite_url",
]
