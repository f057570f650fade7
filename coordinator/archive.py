"""The coordinator's checkpoint archive on disk: the last few verified global states.

Each checkpoint is a peer-format checkpoint file (``engine.checkpoint.Checkpointer``: written
to a temporary file, fsynced, renamed; its state digest recomputed on load) of the round,
θ_g and the outer momentum. ``index.json`` (rewritten atomically after each save) lists
round, digest, size and time of each kept file, so listing the archive reads no tensors;
entries whose file is gone are dropped, and the newest entry is verified in full before it
is served. A crash between the two writes leaves an extra file that the next save prunes.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.checkpoint import Checkpointer
from protocol.errors import ConfigError
from protocol.spec import RunSpec
from protocol.statesync import state_digest

logger = logging.getLogger(__name__)

INDEX = "index.json"


@dataclass(frozen=True)
class ArchivedState:
    """One archived checkpoint, as listed by the archive (no tensors)."""

    round: int
    state_digest: str
    size_bytes: int
    archived_at: float
    file: str


@dataclass(frozen=True)
class LoadedState:
    """A verified archived state, ready to serve."""

    round: int
    params: torch.Tensor
    momentum: torch.Tensor
    state_digest: str


class CheckpointArchive:
    """``directory``: the archive of one run (``spec_digest``); keeps the newest ``keep``."""

    def __init__(self, directory: Path, *, spec_digest: str, keep: int, spec: RunSpec | None = None) -> None:
        if keep < 1:
            raise ConfigError(f"archived checkpoints to keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.checkpointer = Checkpointer(self.directory, spec_digest=spec_digest, keep=keep, spec=spec)
        self.keep = keep

    def save(self, round_: int, params: torch.Tensor, momentum: torch.Tensor, *, now: float) -> ArchivedState:
        """Write a state; returns its listing entry. Older checkpoints beyond ``keep`` are removed."""
        digest = state_digest(round_, params, momentum)
        record = {"round": round_, "params": params, "momentum": momentum, "archived_at": now}
        path = self.checkpointer.save(record, prune=False)
        entry = ArchivedState(round_, digest, path.stat().st_size, now, path.name)
        kept = [e for e in self.list() if e.round != round_ and (self.directory / e.file).exists()]
        # the index first, then the files it no longer lists: a listed file is always on disk
        self._write_index(sorted([entry, *kept], key=lambda e: e.round, reverse=True)[: self.keep])
        self.checkpointer.prune()
        return entry

    def list(self) -> list[ArchivedState]:
        """Kept checkpoints, newest first (from the index; no tensors read)."""
        path = self.directory / INDEX
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
            entries = [ArchivedState(**item) for item in raw]
        except FileNotFoundError:
            return []
        except (ValueError, TypeError) as exc:
            logger.warning("ignoring unreadable archive index %s: %s", path, exc)
            return []
        entries = [e for e in entries if (self.directory / Path(e.file).name).exists()]
        return sorted(entries, key=lambda e: e.round, reverse=True)

    def load_latest(self) -> LoadedState | None:
        """The newest checkpoint that verifies (torn, foreign or edited files are skipped)."""
        record = self.checkpointer.latest()
        if record is None:
            return None
        return LoadedState(record["round"], record["params"], record["momentum"], record["state_digest"])

    def _write_index(self, entries: builtins.list[ArchivedState]) -> None:
        path = self.directory / INDEX
        tmp = path.with_name(f".{INDEX}.{os.getpid()}.tmp")
        with tmp.open("w", encoding="utf-8") as out:
            json.dump([asdict(e) for e in entries], out, indent=1)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
