"""Flat copies of the state kept on the model's accelerator, so that the landing's transfers
run on the landing thread and the training thread only ever copies device to device.

With overlap, a round's host work (the pseudo-gradient, the outer step, the codec residual)
runs on the landing thread while the inner steps go on; what is left on the training thread
is what touches the model: reading it at the launch, adding the re-base shift at the landing,
swapping θ_g in and out for the validation. Through the host, each of those moves the model
over PCIe (4.9 GB for a 1.2B model: ~0.2 s pinned, ~1-2 s pageable) while the GPU waits.
With a mirror the GPU keeps

- ``flat``: the launch point, copied from the model on the training stream at the launch
  (``capture``), then downloaded to the host launch point on the landing thread's stream
  (``download``); once the landing's host half has turned that into the re-base shift, the
  shift is uploaded into it (``upload_shift``) and ``rebase`` adds it to the model;
- ``theta`` (when validating and there is room): θ_g of the round just landed, uploaded on the
  landing thread (``stage_theta``); the validation swaps it into the model with ``flat`` as
  the place the model's own values wait (``swap_in_theta``, ``swap_back``).

Every copy is exact and the re-base is the same element-wise add as through the host, so
replicas stay bit-identical with or without a mirror. A mirror takes one or two copies of the
model in device memory: the trainer makes one only where the device has that room once the
inner steps' own peak is known (``room_for``).
"""

from __future__ import annotations

import logging

import torch

from peer.round.state import parameter_views

logger = logging.getLogger(__name__)

HEADROOM = 0.10
"""Share of the device's memory left free beside a mirror (other processes, fragmentation,
the allocator's growth after the first inner phase)."""


def room_for(device: torch.device, copies: int, numel: int) -> bool:
    """Whether ``copies`` flat float32 vectors of ``numel`` values fit in what the device has free
    now, less ``HEADROOM`` of its total. Only CUDA devices are considered (a host "mirror"
    would be one more model copy in host memory)."""
    if device.type != "cuda":
        return False
    free, total = torch.cuda.mem_get_info(device)
    return copies * numel * 4 <= free - HEADROOM * total


class DeviceMirror:
    """``flat`` (always) and ``theta`` (with ``validate``) on ``device``, and the side stream the
    landing thread moves them on (CUDA; on other devices every call runs synchronously)."""

    def __init__(self, device: torch.device, numel: int, *, validate: bool) -> None:
        self.device = device
        self.flat = torch.empty(numel, dtype=torch.float32, device=device)
        self.theta = torch.empty(numel, dtype=torch.float32, device=device) if validate else None
        self._staged: tuple[int, int] | None = None
        """(round, address of the host vector) of the θ_g ``theta`` holds (``stage_theta``)."""
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._captured: torch.cuda.Event | None = None

    @property
    def nbytes(self) -> int:
        return self.flat.numel() * 4 * (1 if self.theta is None else 2)

    @torch.no_grad()
    def capture(self, model: torch.nn.Module) -> None:
        """Training thread, at the launch: ``flat`` ← θ_local, device to device on the current
        stream (the next inner step is queued after it)."""
        for offset, values in parameter_views(model):
            self.flat[offset : offset + values.numel()].copy_(values)
        if self._stream is not None:
            self._captured = torch.cuda.Event()
            self._captured.record()

    @torch.no_grad()
    def download(self, out: torch.Tensor) -> None:
        """Landing thread: ``out`` (host) ← ``flat`` as captured, on the side stream; returns once
        the copy is done."""
        if self._stream is None:
            out.copy_(self.flat)
            return
        with torch.cuda.stream(self._stream):
            if self._captured is not None:
                self._stream.wait_event(self._captured)
            out.copy_(self.flat, non_blocking=out.is_pinned())
        self._stream.synchronize()

    @torch.no_grad()
    def upload_shift(self, shift: torch.Tensor) -> None:
        """Landing thread: ``flat`` ← the re-base shift (host), on the side stream; returns once
        it is on the device (so ``rebase``, queued later on the training stream, reads it)."""
        self._upload(self.flat, shift)

    @torch.no_grad()
    def rebase(self, model: torch.nn.Module) -> None:
        """Training thread, between two inner steps: θ_local += ``flat`` (the shift)."""
        for offset, values in parameter_views(model):
            values.add_(self.flat[offset : offset + values.numel()])

    @torch.no_grad()
    def stage_theta(self, theta: torch.Tensor, round_: int) -> None:
        """Landing thread: ``theta`` ← θ_g of round ``round_`` (host), for the validation."""
        if self.theta is None:
            return
        self._staged = None
        self._upload(self.theta, theta)
        self._staged = (round_, theta.data_ptr())

    def holds_theta(self, theta: torch.Tensor, round_: int) -> bool:
        """Whether ``theta`` holds θ_g of round ``round_`` as staged from the host vector
        ``theta`` (an adopted state is another vector)."""
        return self.theta is not None and self._staged == (round_, theta.data_ptr())

    def forget_theta(self) -> None:
        self._staged = None

    @torch.no_grad()
    def swap_in_theta(self, model: torch.nn.Module) -> None:
        """Training thread: ``flat`` ← θ_local and θ_local ← the staged θ_g (``swap_back``
        undoes it; ``flat`` is free between a landing and the next launch)."""
        assert self.theta is not None and self._staged is not None
        for offset, values in parameter_views(model):
            end = offset + values.numel()
            self.flat[offset:end].copy_(values)
            values.copy_(self.theta[offset:end])

    @torch.no_grad()
    def swap_back(self, model: torch.nn.Module) -> None:
        """θ_local ← what ``swap_in_theta`` set aside."""
        for offset, values in parameter_views(model):
            values.copy_(self.flat[offset : offset + values.numel()])

    def _upload(self, target: torch.Tensor, source: torch.Tensor) -> None:
        if self._stream is None:
            target.copy_(source)
            return
        with torch.cuda.stream(self._stream):
            target.copy_(source, non_blocking=source.is_pinned())
        self._stream.synchronize()
