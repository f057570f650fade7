"""Buffers for a reducer's decoded parts, reused part after part within a round.

A reducer decodes every sender's copy of each part it reduces (``RobustPartReducer`` averages
them once all are in), then lets them go: at 200M parameters in a group of two that is hundreds
of part-sized tensors a round per fragment, each fresh from the C heap. Here a runner's decoded
parts come from buffers of its own, given back once their part is reduced: a sender holds one
decoded part at a time, so a runner holds about one buffer per sender and part size, and lets
them all go with the round.

What it was meant to cut, the freed memory glibc keeps in the averager (0.07-0.17 GB at 200M),
it did not measurably: 3.17 copies above the runtime floor against 3.10 without it, within the
±0.1 between identical runs (``benchmarks/results/scale-part-buffers-fp16-2026-12-02.md``); the
decoded parts are a minority of what a round allocates (the wire's frames and messages, the
encodings, the means). What did cut it is ``engine.process_memory.release_free_memory`` once
the all-reduce ended. What this still saves is an allocation per sender and part.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch

__all__ = ["PartBuffers"]


class PartBuffers:
    """Free float32 buffers by length; ``decoded`` fills one, ``give`` returns it for the next part."""

    def __init__(self, max_free: int = 64) -> None:
        if max_free < 0:
            raise ValueError(f"max_free must be >= 0, got {max_free}")
        self.max_free = max_free
        """Buffers kept free at most (more given back are left to the heap)."""
        self._free: dict[int, list[torch.Tensor]] = {}
        self._count = 0
        self._lock = threading.Lock()  # taken on executor threads, given back on the event loop
        self.allocated = 0
        """Buffers made fresh so far (the rest were reused)."""

    def __len__(self) -> int:
        return self._count

    def take(self, numel: int) -> torch.Tensor:
        """A contiguous 1-D float32 CPU tensor of ``numel`` values (its contents are garbage)."""
        if numel < 0:
            raise ValueError(f"a buffer of {numel} values")
        with self._lock:
            free = self._free.get(numel)
            if free:
                self._count -= 1
                return free.pop()
            self.allocated += 1
        return torch.empty(numel, dtype=torch.float32)

    def give(self, tensors: Iterable[torch.Tensor]) -> None:
        """Tensors ``take`` handed out that nothing reads any more; kept for the next ``take``."""
        with self._lock:
            for tensor in tensors:
                if self._count >= self.max_free:
                    return
                if tensor.dtype != torch.float32 or tensor.dim() != 1 or not tensor.is_contiguous():
                    raise ValueError(f"not a buffer of this pool: {tensor.dtype} {tuple(tensor.shape)}")
                self._free.setdefault(tensor.numel(), []).append(tensor)
                self._count += 1

    def decoded(self, numel: int, decode_into: Callable[[torch.Tensor], None]) -> torch.Tensor:
        """A buffer of ``numel`` values that ``decode_into`` filled; if it raises, the buffer goes
        back (its garbage is nobody's) and the error propagates."""
        out = self.take(numel)
        try:
            decode_into(out)
        except BaseException:
            self.give([out])
            raise
        return out

    def clear(self) -> None:
        """Let every free buffer go (the round is over)."""
        with self._lock:
            self._free.clear()
            self._count = 0
