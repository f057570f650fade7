"""The averaged updates a member keeps for a few rounds: the reducers' bytes of each round that
landed here, so that a newcomer whose state download outlasted some rounds rolls that state
forward by them (``engine.update_transfer``, ``peer.round.host_passes.roll_forward``) instead of downloading a whole
state again. An update is a few times smaller than a state (the codec's bytes of one vector
against two float32 vectors: 1/4 with fp16, 1/8 with int8, ~1/15 with 4-bit), and it is what
every member receives each round anyway, so a peer whose link carries the all-reduce can always
catch up this way.

One file per round in the store's directory, written part by part as the averaged parts arrive
(``pending``: ``pending-<round>-<random>.bin``, it may not land; the averager holds none of them, where
it held them all until the round's end: half a model's size with fp16) and renamed once the host
says the round landed with the state's digests before and after (``keep``). A file is a
sequence of frames, one per averaged part in the order they arrived: ``start`` (u64),
``length`` (u32), then the part's serialized ``runtime_pb2.Tensor``; the kept update's
``order`` (each frame's place in the file, by ``start``) reads them in vector order. Nothing here is trusted by a reader: the downloader checks every frame
(``engine.update_transfer``) and the digest of the state it makes (``peer.round.host_passes.roll_forward``).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
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
    order: tuple[int, ...] = ()
    """Each frame's offset in the file, in vector order (``read_frames``)."""


class PendingUpdate:
    """One round's averaged parts, written to its pending file as they arrive (``add``, on any
    thread) until ``finish``; a newer round's, or ``UpdateStore.keep`` before ``finish``, drops it."""

    def __init__(self, store: UpdateStore, round_: int) -> None:
        self.store, self.round = store, round_
        self.path = store.directory / f"pending-{round_}-{secrets.token_hex(4)}.bin"  # a retry's is another
        self._out = open(self.path, "wb")
        self._frames: list[tuple[int, int]] = []  # (start, offset)
        self.size = 0
        self.finished = False
        self._lock = threading.Lock()

    def add(self, start: int, part: runtime_pb2.Tensor) -> None:
        raw = part.SerializeToString()
        with self._lock:
            if self._out.closed:  # dropped: a newer round's began (this one will not land)
                return
            self._frames.append((start, self._out.tell()))
            self._out.write(FRAME.pack(start, len(raw)))
            self._out.write(raw)
            self.size += len(part.buffer)

    def at(self, base: int) -> Callable[[int, runtime_pb2.Tensor], None]:
        """``add`` for a fragment starting at ``base`` (its parts' starts are within it)."""
        return lambda start, part: self.add(base + start, part)

    def order(self) -> tuple[int, ...]:
        return tuple(offset for _start, offset in sorted(self._frames))

    def finish(self) -> None:
        """Every part is in: the file is complete (``UpdateStore.keep`` may keep it)."""
        with self._lock:
            if not self._out.closed:
                self._out.close()
                self.finished = True

    def drop(self) -> None:
        with self._lock:
            self._out.close()
            self.finished = False
        self.path.unlink(missing_ok=True)


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
        self._pending: dict[int, PendingUpdate] = {}
        self._lock = threading.Lock()
        if directory.exists():  # a previous run's files: nothing in them is known to be ours
            shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True, exist_ok=True)

    def pending(self, round_: int) -> PendingUpdate:
        """A new pending update of ``round_``, to write its parts into as they arrive; pending
        updates of rounds before the one before it are dropped (they never landed)."""
        update = PendingUpdate(self, round_)
        with self._lock:
            replaced = self._pending.pop(round_, None)
            self._pending[round_] = update
            stale = [self._pending.pop(r) for r in [r for r in self._pending if r < round_ - 1]]
        for old in [u for u in (replaced, *stale) if u is not None]:
            old.drop()
        return update

    def write_pending(self, round_: int, parts: Sequence[tuple[int, runtime_pb2.Tensor]]) -> None:
        """Write the round's averaged parts (``(start, part)``, any order) as its pending update."""
        update = self.pending(round_)
        for start, part in parts:
            update.add(start, part)
        update.finish()

    def keep(self, round_: int, pre: str, post: str, left_out: Sequence[tuple[int, int]]) -> bool:
        """The round's pending update landed here, from state ``pre`` to ``post``: keep it (and
        drop rounds older than the newest ``keep_rounds``). False if no such update was written
        whole."""
        with self._lock:
            pending = self._pending.pop(round_, None)
            if pending is None or not pending.finished:
                if pending is not None:
                    pending.drop()
                return False
            kept_path = self.directory / f"round-{round_}.bin"
            os.replace(pending.path, kept_path)
            self._kept[round_] = KeptUpdate(
                round_,
                pre,
                post,
                tuple((int(lo), int(hi)) for lo, hi in left_out),
                kept_path,
                len(pending.order()),
                pending.size,
                pending.order(),
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


def read_frames(path: Path, order: Sequence[int] | None = None) -> Iterator[tuple[int, bytes]]:
    """``(start, serialized part)`` of each frame of a kept update's file, in the file's order or
    at ``order``'s offsets (``KeptUpdate.order``: vector order). A file the store wrote (its
    own) is trusted to be well formed; a truncated one ends the iteration with an error."""
    with open(path, "rb") as source:
        offsets = iter(order) if order is not None else None
        while True:
            if offsets is not None:
                offset = next(offsets, None)
                if offset is None:
                    return
                source.seek(offset)
            header = source.read(FRAME.size)
            if not header:
                return
            if len(header) != FRAME.size:
                raise OSError(f"{path}: truncated frame header")
            start, length = FRAME.unpack(header)
            raw = source.read(length)
            if len(raw) != length:
                raise OSError(f"{path}: truncated frame")
            yield start, raw
