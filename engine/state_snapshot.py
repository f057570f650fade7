"""The state a member serves a newcomer, as a file: written once per round it is asked for,
streamed from disk a chunk at a time.

A state download used to hold the state (θ_g and the outer momentum) several times over in
memory: the host's clone, the clone moved to the averager process through shared memory, and
hivemind's whole serialization of it, all held while the newcomer's link took the bytes
(minutes, for a big model on a home link), once per download. Now the host writes the two
vectors straight from their memory into a file beside the kept updates (``write``; page cache,
not the process's memory), once per round whatever the number of downloaders, and the averager
reads the file a chunk at a time as the stream goes (``chunks``). The trainer writes without
holding its state's lock, so that a slow disk never holds up a landing, and serves the file
only if no landing went on meanwhile (``Trainer._serve``). A download that outlives its round
keeps reading the file it opened: the next round's snapshot replaces the name, not the file.

The stream is the one hivemind's ``rpc_download_state`` sends (a float32 vector per tensor,
the first part with its dtype and size, then buffers alone), so the downloader
(``engine.state_transfer``) is unchanged and checks the digest as before.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
from hivemind.proto import runtime_pb2

__all__ = ["CHUNK_BYTES", "SNAPSHOT_GLOB", "StateSnapshots", "chunks"]

logger = logging.getLogger(__name__)

CHUNK_BYTES = 1 << 20
"""Bytes of a vector per message of the download stream (hivemind's state chunks are 512 KiB)."""
SNAPSHOT_GLOB = "state-*.bin"
FLOAT32 = 4


class StateSnapshots:
    """The host side: the latest served state's file in ``directory`` (a temporary one if None)."""

    def __init__(self, directory: Path | None) -> None:
        self._directory = directory
        self._made = False
        """Whether ``_directory`` is a temporary one of ours (removed by ``close``)."""
        self._current: tuple[int, str, Path] | None = None
        self._lock = threading.Lock()

    def write(self, round_: int, params: torch.Tensor, momentum: torch.Tensor, digest: str) -> dict[str, Any]:
        """The state's file, written unless this round's is there already (a provider that
        finds the state changed while it was written serves nothing: ``StateProvider``). What the averager process needs to stream it: the round, the
        digest, the file, the values per vector."""
        if params.shape != momentum.shape or params.dim() != 1:
            raise ValueError(f"a served state is two flat vectors of one size, not {params.shape} and {momentum.shape}")
        with self._lock:
            current = self._current
            if current is not None and current[:2] == (round_, digest) and current[2].exists():
                path = current[2]
            else:
                path = self._write(round_, digest, (params, momentum))
                self._current = (round_, digest, path)
                if current is not None and current[2] != path:
                    current[2].unlink(missing_ok=True)  # a reader that has it open keeps reading it
        return {"round": round_, "digest": digest, "snapshot": str(path), "numel": params.numel()}

    @property
    def path(self) -> Path | None:
        """The latest snapshot's file, or None."""
        current = self._current
        return current[2] if current is not None else None

    def close(self) -> None:
        """Remove the file (the averager is shutting down)."""
        with self._lock:
            if self._current is not None:
                self._current[2].unlink(missing_ok=True)
                self._current = None
            if self._made and self._directory is not None:
                shutil.rmtree(self._directory, ignore_errors=True)
                self._directory, self._made = None, False

    def _write(self, round_: int, digest: str, vectors: tuple[torch.Tensor, ...]) -> Path:
        directory = self._where()
        final = directory / f"state-{round_}-{digest.split(':')[-1][:16]}.bin"
        handle, temporary = tempfile.mkstemp(prefix=".state-", suffix=".tmp", dir=directory)
        try:
            with os.fdopen(handle, "wb") as out:
                for vector in vectors:
                    values = vector.detach().to("cpu", torch.float32).contiguous()
                    out.write(values.numpy().data)  # from the tensor's memory: no copy of it
            os.replace(temporary, final)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise
        return final

    def _where(self) -> Path:
        if self._directory is None:
            self._directory, self._made = Path(tempfile.mkdtemp(prefix="swarmtrain-state-")), True
        elif self._current is None:  # the first snapshot: files a crashed run left are nobody's now
            self._directory.mkdir(parents=True, exist_ok=True)
            for stale in [*self._directory.glob(SNAPSHOT_GLOB), *self._directory.glob(".state-*.tmp")]:
                stale.unlink(missing_ok=True)
        return self._directory


def chunks(source: IO[bytes], numel: int, vectors: int = 2) -> Iterator[runtime_pb2.Tensor]:
    """The download stream's tensor parts of ``vectors`` float32 vectors of ``numel`` values read
    from ``source`` (``StateSnapshots.write``'s file, open): the first part of each with its
    dtype and size (a new tensor begins), the others buffers alone. ``OSError`` if the file is
    short."""
    for _ in range(vectors):
        remaining, first = numel * FLOAT32, True
        while remaining or first:
            buffer = source.read(min(CHUNK_BYTES, remaining))
            if len(buffer) == 0 and remaining:
                raise OSError(f"the state's file ends {remaining} bytes short")
            remaining -= len(buffer)
            if first:
                yield runtime_pb2.Tensor(buffer=buffer, size=[numel], dtype="float32", requires_grad=False)
                first = False
            else:
                yield runtime_pb2.Tensor(buffer=buffer)
