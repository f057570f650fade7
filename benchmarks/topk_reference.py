"""SparseLoCo's codec as a reference for the training-quality benchmark (issue #33): each
member's own top-k per chunk, in 2 bits, with error feedback, averaged as an all-gather.

Not a codec the product ships: members' top-k sets differ, so a reducer's average has their
union as support and the butterfly's return leg could not send it sparsely; SparseLoCo and
Psyche gather every member's payload instead, ``n - 1`` payloads per member per round. Here
the in-process swarm (``benchmarks.loopback_group``) averages the members' decoded payloads
exactly, as each member of an all-gather would, with no second encoding (``gathered``).

Wire format of one chunk of ``CHUNK`` values (a shorter last chunk keeps ``min(K, n)``): ``K``
uint16 little-endian positions, ascending, then the ``2bit`` encoding of the ``K`` values (one
float32 scale and ``K`` 2-bit codes). At ``CHUNK`` 4096 and ``K`` 64 (Templar's and
Covenant's 1.56%): 148 bytes a chunk, 0.036 bytes per value, 0.9% of fp32 per payload.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.compression import Codec, ErrorFeedback, TwoBitCodec, _check_input, _check_numel
from protocol.errors import MalformedTensorError

CHUNK = 4096
K = 64
DECAY = 0.95
"""SparseLoCo's error-feedback decay (Templar's ``momentum_decay``), in place of outer momentum."""


class DecayedFeedback(ErrorFeedback):
    """SparseLoCo's error feedback: ``e <- DECAY e + delta``, send ``C(e)``, ``e <- e - D(C(e))``."""

    def add_into(self, out: torch.Tensor, offset: int) -> None:
        out.add_(self._residual[offset : offset + out.numel()], alpha=DECAY)


class TopKCodec(Codec):
    """Each chunk's ``K`` largest values by magnitude, in 2 bits, at their positions."""

    name = "topk"
    block = CHUNK
    lossy = True
    gathered = True
    """Averaged as an all-gather: every member decodes every payload (``benchmarks.loopback_group``)."""

    def __init__(self) -> None:
        self._values = TwoBitCodec()

    def bytes_per_value(self) -> float:
        return (2 * K + self._values.encoded_size(K)) / CHUNK

    def _kept(self, numel: int) -> list[int]:
        full, tail = divmod(numel, CHUNK)
        return [K] * full + ([min(K, tail)] if tail else [])

    def encoded_size(self, numel: int) -> int:
        _check_numel(numel, self.name)
        kept = self._kept(numel)
        return 2 * sum(kept) + self._values.encoded_size(sum(kept))

    def _select(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(absolute positions, values) of each chunk's top ``K``, chunk by chunk, ascending."""
        positions = []
        for start in range(0, x.numel(), CHUNK):
            chunk = x[start : start + CHUNK]
            top = torch.topk(chunk.abs(), min(K, chunk.numel()), sorted=False).indices.sort().values
            positions.append(top + start)
        where = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.int64)
        return where, x[where]

    def encode(self, x: torch.Tensor) -> bytes:
        x = _check_input(x, self.name)
        where, values = self._select(x)
        local = (where % CHUNK).to(torch.int64).numpy().astype("<u2").tobytes()
        return local + self._values.encode(values.contiguous())

    def decode(self, data: bytes, numel: int) -> torch.Tensor:
        raw = self._check_length(data, numel)
        kept = self._kept(numel)
        total = sum(kept)
        local = torch.from_numpy(np.frombuffer(raw, dtype="<u2", count=total).astype(np.int64))
        starts = torch.repeat_interleave(torch.arange(len(kept)) * CHUNK, torch.tensor(kept, dtype=torch.int64))
        where = local + starts
        out = torch.zeros(numel, dtype=torch.float32)
        offset = 0
        for i, count in enumerate(kept):
            run = local[offset : offset + count]
            if count and (bool((run[1:] <= run[:-1]).any()) or int(run[-1]) >= min(CHUNK, numel - i * CHUNK)):
                raise MalformedTensorError(f"{self.name} codec: chunk {i}'s positions are not ascending within it")
            offset += count
        out[where] = self._values.decode(raw[2 * total :], total)
        return out

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        x = _check_input(x, self.name)
        where, values = self._select(x)
        out = torch.zeros_like(x)
        out[where] = self._values.roundtrip(values.contiguous())
        return out
