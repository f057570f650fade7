"""The checkpoint format, shared by a peer's local checkpoints and the coordinator's archive:
written atomically, verified on load, the last few kept.

A checkpoint holds the global state (round, θ_g, outer momentum, its digest), the local
model, the inner optimizer, the codec residual and the inner step count, for the run whose
spec digest it names. ``latest`` skips (with a warning) files that are torn, for another
run, or whose recomputed state digest differs from the one stored.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from protocol.errors import ConfigError
from protocol.pids import pid_alive
from protocol.spec import RunSpec
from protocol.statesync import state_digest

logger = logging.getLogger(__name__)

FORMAT = 1
_PREFIX, _SUFFIX = "round-", ".pt"


class Checkpointer:
    """Saves to and restores from one directory."""

    def __init__(self, directory: Path, *, spec_digest: str, keep: int = 2, spec: RunSpec | None = None) -> None:
        """``spec``: the run's spec, written into each checkpoint so that one found on disk says
        which run it is (``swarmtrain export`` needs nothing else); its digest is ``spec_digest``."""
        if spec is not None and spec.digest() != spec_digest:
            raise ValueError("the spec given is not the run spec_digest names")
        self._spec_json = spec.canonical_json().decode() if spec is not None else None
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
            if pid.isdigit() and int(pid) != os.getpid() and pid_alive(int(pid)):
                continue
            logger.info("removing %s, left by a writer that stopped mid-write", tmp.name)
            tmp.unlink(missing_ok=True)

    def save(self, payload: dict[str, Any], *, prune: bool = True, digest: str | None = None) -> Path:
        """Write ``payload`` (must hold round, params, momentum) as the newest checkpoint; then,
        unless ``prune`` is False (the caller calls ``prune()`` itself), drop the oldest beyond
        ``keep``. ``digest``: the state's digest when the caller already has it (else computed)."""
        record = {"format": FORMAT, "spec_digest": self.spec_digest, **payload}
        if self._spec_json is not None:
            record["spec_json"] = self._spec_json
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
        return checkpoint_problem(record, self.spec_digest)

    def _files(self) -> list[Path]:
        return [p for p in self.directory.glob(f"{_PREFIX}*{_SUFFIX}") if p.is_file()]

    def prune(self) -> None:
        """Delete all but the newest ``keep`` checkpoints."""
        for old in sorted(self._files(), reverse=True)[self.keep :]:
            old.unlink(missing_ok=True)


def checkpoint_problem(record: Any, spec_digest: str) -> str | None:
    """What makes a loaded checkpoint unusable for the run ``spec_digest``, or None: another
    format, another run, missing parts, or a state that does not match its digest."""
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        return "not a swarmtrain checkpoint of this format"
    if record.get("spec_digest") != spec_digest:
        return f"made for another run ({record.get('spec_digest')})"
    try:
        digest = state_digest(record["round"], record["params"], record["momentum"])
    except (KeyError, TypeError, ValueError) as exc:
        return f"incomplete ({exc})"
    if digest != record.get("state_digest"):
        return "state does not match its digest (corrupted or edited)"
    return None


def read_checkpoint(path: Path, *, spec_digest: str | None = None) -> dict[str, Any]:
    """The checkpoint at ``path`` (a file, or a directory of them: its newest that verifies),
    verified, for the run ``spec_digest`` (None: the run the checkpoint carries, ``spec_json``,
    itself checked against the digest it names); ConfigError naming the file and what is wrong."""
    path = Path(path)
    if path.is_dir():
        files = sorted((p for p in path.glob(f"{_PREFIX}*{_SUFFIX}") if p.is_file()), reverse=True)
        if not files:
            raise ConfigError(f"{path}: holds no checkpoint ({_PREFIX}*{_SUFFIX})")
        problems = []
        for file in files:
            try:
                return read_checkpoint(file, spec_digest=spec_digest)
            except ConfigError as exc:
                logger.warning("skipping %s", exc)
                problems.append(str(exc))
        raise ConfigError(f"{path}: no checkpoint there verifies (newest: {problems[0]})")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such file or directory") from exc
    except Exception as exc:
        raise ConfigError(f"{path}: not a readable checkpoint ({type(exc).__name__}: {str(exc)[:120]})") from exc
    if spec_digest is None and isinstance(loaded, dict):
        spec_digest = _carried_digest(loaded, path)
    problem = checkpoint_problem(loaded, spec_digest or "")
    if problem is not None:
        raise ConfigError(f"{path}: {problem}")
    return dict(loaded)


def checkpoint_spec(record: dict[str, Any]) -> RunSpec | None:
    """The run spec a checkpoint carries (None for one written before checkpoints did)."""
    text = record.get("spec_json")
    if not isinstance(text, str):
        return None
    try:
        return RunSpec.model_validate(json.loads(text))
    except ValueError:
        return None


def _carried_digest(record: dict[str, Any], path: Path) -> str:
    spec = checkpoint_spec(record)
    if spec is None:
        raise ConfigError(f"{path}: carries no run spec (written by an older swarmtrain): pass the run's --spec")
    if spec.digest() != record.get("spec_digest"):
        raise ConfigError(f"{path}: the spec it carries is not the run it names (corrupted or edited)")
    return spec.digest()


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
