"""The checkpoint format, shared by a peer's local checkpoints and the coordinator's archive:
written atomically, verified on load, the last few kept.

A checkpoint holds the global state (round, θ_g, outer momentum, its digest), the local
model, the inner optimizer, the codec residual and the inner step count, for the run whose
spec digest it names. ``latest`` skips (with a warning) files that are torn, for another
run, or whose recomputed state digest differs from the one stored.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from protocol.errors import ConfigError
from protocol.statesync import state_digest

logger = logging.getLogger(__name__)

FORMAT = 1
_PREFIX, _SUFFIX = "round-", ".pt"


class Checkpointer:
    """Saves to and restores from one directory."""

    def __init__(self, directory: Path, *, spec_digest: str, keep: int = 2) -> None:
        if keep < 1:
            raise ConfigError(f"checkpoints to keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.spec_digest = spec_digest
        self.keep = keep
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"{self.directory}: cannot create checkpoint directory ({exc.strerror})") from exc
        self._remove_torn()

    def _remove_torn(self) -> None:
        """Delete half-written files a killed writer left (``.round-*.<pid>.tmp``: each as large
        as a checkpoint, one more per crash) unless their writer still runs."""
        for tmp in self.directory.glob(f".{_PREFIX}*{_SUFFIX}.*.tmp"):
            pid = tmp.name.rsplit(".", 2)[-2]
            if pid.isdigit() and int(pid) != os.getpid() and _alive(int(pid)):
                continue
            logger.info("removing %s, left by a writer that stopped mid-write", tmp.name)
            tmp.unlink(missing_ok=True)

    def save(self, payload: dict[str, Any], *, prune: bool = True, digest: str | None = None) -> Path:
        """Write ``payload`` (must hold round, params, momentum) as the newest checkpoint; then,
        unless ``prune`` is False (the caller calls ``prune()`` itself), drop the oldest beyond
        ``keep``. ``digest``: the state's digest when the caller already has it (else computed)."""
        record = {"format": FORMAT, "spec_digest": self.spec_digest, **payload}
        if digest is None:
            digest = state_digest(record["round"], record["params"], record["momentum"])
        record["state_digest"] = digest
        path = self.directory / f"{_PREFIX}{record['round']:09d}{_SUFFIX}"
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        with tmp.open("wb") as out:
            torch.save(record, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
        _sync_directory(self.directory)  # the rename itself survives a power loss
        if prune:
            self.prune()
        return path

    def latest(self) -> dict[str, Any] | None:
        """The newest checkpoint that verifies, or None."""
        for path in sorted(self._files(), reverse=True):
            try:
                record = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - a torn or foreign file: try the previous one
                logger.warning("skipping unreadable checkpoint %s: %s", path, exc)
                continue
            problem = self._problem(record)
            if problem:
                logger.warning("skipping checkpoint %s: %s", path, problem)
                continue
            return record
        return None

    def _problem(self, record: Any) -> str | None:
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            return "not a swarmtrain checkpoint of this format"
        if record.get("spec_digest") != self.spec_digest:
            return f"made for another run ({record.get('spec_digest')})"
        try:
            digest = state_digest(record["round"], record["params"], record["momentum"])
        except (KeyError, TypeError, ValueError) as exc:
            return f"incomplete ({exc})"
        if digest != record.get("state_digest"):
            return "state does not match its digest (corrupted or edited)"
        return None

    def _files(self) -> list[Path]:
        return [p for p in self.directory.glob(f"{_PREFIX}*{_SUFFIX}") if p.is_file()]

    def prune(self) -> None:
        """Delete all but the newest ``keep`` checkpoints."""
        for old in sorted(self._files(), reverse=True)[self.keep :]:
            old.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sync_directory(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot sync a directory
    finally:
        os.close(fd)
