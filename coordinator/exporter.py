"""The archive's newest checkpoint as a model anyone downloads: the coordinator's dashboard and
API link it (``/api/v1/model``, ``/model/FILE``).

A thread looks at the archive every few seconds; when it holds a round newer than the last
export, it runs ``swarmtrain export`` on that checkpoint in a child process (transformers, the
model's build and its memory stay out of the coordinator's interpreter, whose heartbeats must
not wait; on the CPU, at low priority), into ``STATE_DIR/export/round-NNNNNNNNN``, and keeps only
the newest. A failed export is retried only for a newer round; its last line is ``last_error``.
The child is the command's contract (a directory it writes whole, or not at all), so the
coordinator imports nothing of the peer's model code.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from coordinator.archive import CheckpointArchive

logger = logging.getLogger(__name__)

POLL_S = 5.0
EXPORT_TIMEOUT_S = 3600.0
PROVENANCE = "swarmtrain.json"
_PREFIX = "round-"


@dataclass(frozen=True)
class ExportedFile:
    name: str
    bytes: int


@dataclass(frozen=True)
class ExportedModel:
    """The newest export: what ``swarmtrain.json`` says, and its files."""

    round: int
    state_digest: str
    architecture: str
    parameters: int
    directory: Path
    files: tuple[ExportedFile, ...]


class ModelExporter:
    """Exports ``archive``'s newest checkpoint into ``directory`` whenever it is newer."""

    def __init__(self, archive: CheckpointArchive, directory: Path, *, poll_s: float = POLL_S) -> None:
        self.archive, self.directory, self.poll_s = archive, Path(directory), poll_s
        self.directory.mkdir(parents=True, exist_ok=True)
        self.last_error = ""
        self._tried: int | None = None
        self._latest = _newest(self.directory)
        self._proc: subprocess.Popen[str] | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="exporter", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
        self._thread.join(timeout=10)

    def latest(self) -> ExportedModel | None:
        return self._latest

    def file(self, name: str) -> Path | None:
        """The newest export's file ``name`` (only a name it lists: nothing else is served)."""
        latest = self._latest
        if latest is None or name not in {f.name for f in latest.files}:
            return None
        return latest.directory / name

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.poll()
            except Exception:
                logger.exception("model export failed")

    def poll(self) -> None:
        """Export the archive's newest round if no export of it exists or was tried."""
        kept = self.archive.list()
        if not kept:
            return
        newest = kept[0]
        done = self._latest.round if self._latest is not None else None
        if newest.round in (done, self._tried) or (done is not None and newest.round < done):
            return
        self._tried = newest.round
        out = self.directory / f"{_PREFIX}{newest.round:09d}"
        shutil.rmtree(out, ignore_errors=True)  # a half export a killed child left
        argv = [
            sys.executable,
            "-m",
            "swarmtrain",
            "export",
            str(self.archive.directory / newest.file),
            "--out",
            str(out),
        ]
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
        with self._lock:
            if self._stop.is_set():
                return
            self._proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            try:
                os.setpriority(os.PRIO_PROCESS, self._proc.pid, 10)  # behind the coordinator's own threads
            except OSError:
                pass
        try:
            output, _ = self._proc.communicate(timeout=EXPORT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            output, _ = self._proc.communicate()
        if self._proc.returncode != 0:
            lines = [line for line in output.splitlines() if line.strip()]
            self.last_error = lines[-1] if lines else f"swarmtrain export exited with {self._proc.returncode}"
            logger.warning("exporting archived round %d failed: %s", newest.round, self.last_error)
            return
        exported = _read(out)
        if exported is None:
            self.last_error = f"{out}: the export wrote no readable {PROVENANCE}"
            return
        self._latest, self.last_error = exported, ""
        logger.info("exported archived round %d as a model in %s", newest.round, out)
        for old in self.directory.glob(f"{_PREFIX}*"):
            if old != out:
                shutil.rmtree(old, ignore_errors=True)


def _newest(directory: Path) -> ExportedModel | None:
    for candidate in sorted(directory.glob(f"{_PREFIX}*"), reverse=True):
        exported = _read(candidate)
        if exported is not None:
            return exported
    return None


def _read(directory: Path) -> ExportedModel | None:
    try:
        meta = json.loads((directory / PROVENANCE).read_text(encoding="utf-8"))
        files = tuple(ExportedFile(p.name, p.stat().st_size) for p in sorted(directory.iterdir()) if p.is_file())
        return ExportedModel(
            round=int(meta["round"]),
            state_digest=str(meta["state_digest"]),
            architecture=str(meta["architecture"]),
            parameters=int(meta["parameters"]),
            directory=directory,
            files=files,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
