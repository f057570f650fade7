"""The averaged updates a member keeps for a few rounds: the reducers' bytes of each round that
landed here, so that a newcomer whose state download outlasted some rounds rolls that state
forward by them (``engine.update_transfer``, ``peer.round.host_passes.roll_forward``) instead of downloading a whole
state again. An update is a few times smaller than a state (the codec's bytes of one vector
against two float32 vectors: 1/4 with fp16, 1/8 with int8, ~1/15 with 4-bit), and it is what
every member receives each round anyway, so a peer whose link carries the all-reduce can always
catch up this way.

One file per round in the store's directory, written on a thread as the all-reduce ends
(``pending-<round>.bin``: it may not land) and renamed once the host says the round landed
with the state's digests before and after (``keep``). A file is a sequence of frames, one per
averaged part in vector order: ``start`` (u64), ``length`` (u32), then the part's serialized
``runtime_pb2.Tensor``. Nothing here is trusted by a reader: the downloader checks every frame
(``engine.update_transfer``) and the digest of the state it makes (``peer.round.host_passes.roll_forward``).
"""

from __future__ import annotations

import logging
import os
import shutil
import struct
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (the parts are only serialized here: the peer's CLI imports this module early)
    from hivemind.proto import runtime_pb2

logger = logging.getLogger(__name__)

FRAME = struct.Struct("<QI")
"""A frame's header: the part's first value's position in the vector, its serialized length."""
KEPT_ROUNDS = 16
"""Rounds of updates a member keeps by default: a newcomer whose state download outlasted more
rounds than this (or than ``KEPT_BYTES`` hold) downloads a newer state instead, and chases the
swarm as it would without updates."""
KEPT_BYTES = 4 << 30
"""Disk a member's kept updates take at most (the newest round is kept whatever its size): 16
rounds of a 1B model's updates with the sparse codec take 1.3 GB, with fp16 two rounds fit."""


@dataclass(frozen=True)
class KeptUpdate:
    """The update that turned the state of ``round`` (digest ``pre``) into that of ``round + 1``
    (digest ``post``); ``left_out``: ranges the round did not average (an audit left them out)."""

    round: int
    pre: str
    post: str
    left_out: tuple[tuple[int, int], ...]
    path: Path
    parts: int
    size: int
    """Bytes of the parts' buffers (what a downloader receives, less framing)."""


class UpdateStore:
    """A directory of kept updates, the newest ``keep`` rounds in at most ``max_bytes``. Thread-safe: written on the
    averager's executor threads, read by its serving coroutines."""

    def __init__(self, directory: Path, keep: int = KEPT_ROUNDS, max_bytes: int = KEPT_BYTES) -> None:
        if keep < 1:
            raise ValueError("an update store keeps at least one round")
        self.directory = directory
        self.keep_rounds = keep
        self.max_bytes = max_bytes
        self._kept: dict[int, KeptUpdate] = {}
        self._pending: dict[int, tuple[Path, int, int]] = {}
        self._lock = threading.Lock()
        if directory.exists():  # a previous run's files: nothing in them is known to be ours
            shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)

    def write_pending(self, round_: int, parts: Sequence[tuple[int, runtime_pb2.Tensor]]) -> None:
        """Write the round's averaged parts (``(start, part)``, any order) as its pending update."""
        path = self.directory / f"pending-{round_}.bin"
        size = 0
        with open(path, "wb") as out:
            for start, part in sorted(parts, key=lambda item: item[0]):
                raw = part.SerializeToString()
                out.write(FRAME.pack(start, len(raw)))
                out.write(raw)
                size += len(part.buffer)
        with self._lock:
            self._pending[round_] = (path, len(parts), size)
            for old in [r for r in self._pending if r < round_ - 1]:
                stale, _, _ = self._pending.pop(old)
                stale.unlink(missing_ok=True)

    def keep(self, round_: int, pre: str, post: str, left_out: Sequence[tuple[int, int]]) -> bool:
        """The round's pending update landed here, from state ``pre`` to ``post``: keep it (and
        drop rounds older than the newest ``keep_rounds``). False if no such update was written."""
        with self._lock:
            pending = self._pending.pop(round_, None)
            if pending is None:
                return False
            path, parts, size = pending
            kept_path = self.directory / f"round-{round_}.bin"
            os.replace(path, kept_path)
            self._kept[round_] = KeptUpdate(
                round_, pre, post, tuple((int(lo), int(hi)) for lo, hi in left_out), kept_path, parts, size
            )
            rounds = sorted(self._kept)
            held = sum(update.size for update in self._kept.values())
            for old in rounds[:-1]:
                if len(self._kept) <= self.keep_rounds and held <= self.max_bytes:
                    break
                dropped = self._kept.pop(old)
                held -= dropped.size
                dropped.path.unlink(missing_ok=True)
        return True

    def chain(self, round_: int, digest: str) -> list[KeptUpdate]:
        """The kept updates that take the state of ``round_`` with ``digest`` forward, in order,
        as far as this store holds them unbroken (empty if it holds none from that state)."""
        chain: list[KeptUpdate] = []
        with self._lock:
            while (update := self._kept.get(round_)) is not None and update.pre == digest:
                chain.append(update)
                round_, digest = round_ + 1, update.post
        return chain

    def rounds(self) -> list[int]:
        with self._lock:
            return sorted(self._kept)

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)


def read_frames(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(start, serialized part)`` of each frame of a kept update's file. A file the store wrote
    (its own) is trusted to be well formed; a truncated one ends the iteration with an error."""
    with open(path, "rb") as source:
        while header := source.read(FRAME.size):
            if len(header) != FRAME.size:
                raise OSError(f"{path}: truncated frame header")
            start, length = FRAME.unpack(header)
            raw = source.read(length)
            if len(raw) != length:
                raise OSError(f"{path}: truncated frame")
            yield start, raw
