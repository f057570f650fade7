"""The causal LM's output head fused with its loss: next-token cross-entropy computed a chunk of
tokens at a time, so the whole batch's logits never exist at once.

A 128,256-token vocabulary makes the logits the largest tensor of a 1B model's step: 8 x 2,048
tokens hold 4.2 GB of bf16 logits, 8.4 GB again in fp32 for the loss and as much for their
gradient, written and read by unfused kernels. Here each chunk's logits (at most
``protocol.modelsize.LOSS_CHUNK_BYTES`` in fp32) are made, reduced to the loss and turned into the chunk's gradients
(softmax minus the one-hot target, times the head's weight and the chunk's hidden states) in
the forward pass; the backward pass only scales the stored gradients by the incoming one. The
math is the same mean cross-entropy; the head's matrix products run in the autocast dtype, the
softmax and the weight's gradient accumulate in fp32.

``LossHead`` takes the place of the transformers model's ``lm_head`` (the same weight
parameter, so tying, the parameter count and the state dict are unchanged) and returns the
loss as the model's ``logits`` while ``scoring(targets)`` is active: the loss stays inside the
model's forward, which is what DDP and FSDP2 wrap, and ``peer.task.causal_lm.causal_lm_loss``
is its only caller. Outside ``scoring`` it is the plain linear head.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from protocol.modelsize import loss_chunk_rows


def even_chunks(n: int, rows: int) -> list[tuple[int, int]]:
    """``n`` positions cut into as few chunks of at most ``rows`` as can be, of equal sizes (to
    within one): a compiled chunk step then meets at most two shapes."""
    count = -(-n // rows)
    bounds = [n * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def softmax_grad(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The summed cross-entropy of ``logits`` (c, V) against ``targets`` (c,), in fp32, and its
    gradient with respect to the logits (softmax minus one-hot) in the logits' dtype."""
    logp = torch.log_softmax(logits, dim=1, dtype=torch.float32)
    loss = -logp.gather(1, targets[:, None]).sum()
    grad = logp.exp_()
    grad[torch.arange(targets.shape[0], device=targets.device), targets] -= 1.0
    return loss, grad.to(logits.dtype)


_compiled_softmax_grad = None


def _softmax_grad_fn(compiled: bool) -> Any:
    """``softmax_grad``, or its ``torch.compile`` (one fused pass over a chunk's logits instead
    of five), made once per process."""
    global _compiled_softmax_grad
    if not compiled:
        return softmax_grad
    if _compiled_softmax_grad is None:
        _compiled_softmax_grad = torch.compile(softmax_grad, dynamic=False)
    return _compiled_softmax_grad


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``, gradients made in forward."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        rows: int,
        dtype: torch.dtype,
        compiled: bool,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        step = _softmax_grad_fn(compiled)
        with torch.autocast(hidden.device.type, enabled=False):
            h = hidden.to(dtype)
            w = weight.to(dtype)
            grad_h = torch.empty_like(h)
            grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
            total = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start, end in even_chunks(n, rows):
                hc = h[start:end]
                loss, g = step(hc @ w.T, targets[start:end])
                total += loss
                grad_h[start:end] = g @ w
                grad_w += (g.T @ hc).float()
                del g
        ctx.save_for_backward(grad_h, grad_w)
        ctx.n = n
        ctx.hidden_dtype = hidden.dtype
        ctx.weight_dtype = weight.dtype
        return total / n

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad_h, grad_w = ctx.saved_tensors
        scale = grad_out.float() / ctx.n
        return (
            (grad_h.float() * scale).to(ctx.hidden_dtype),
            (grad_w * scale).to(ctx.weight_dtype),
            None,
            None,
            None,
            None,
        )


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    rows: int | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T`` (``hidden`` (N, H), ``weight`` (V, H),
    ``targets`` (N,) in [0, V)), in fp32, computed at most ``rows`` tokens at a time (default:
    within ``LOSS_CHUNK_BYTES``), the softmax step compiled if ``compiled``. Matrix products run in
    the autocast dtype when autocast is on."""
    vocab = weight.shape[0]
    rows = rows or loss_chunk_rows(vocab)
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype
    if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(hidden, weight, targets, rows, dtype, compiled)
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    with torch.autocast(device, enabled=False):
        w = weight.to(dtype)
        for start, end in even_chunks(hidden.shape[0], rows):
            logits = hidden[start:end].to(dtype) @ w.T
            total += F.cross_entropy(logits.float(), targets[start:end], reduction="sum")
    return total / hidden.shape[0]


class LossHead(torch.nn.Module):
    """A bias-free linear output head that, while ``scoring(targets)`` is active, returns the
    mean next-token loss of its input against ``targets`` instead of logits."""

    def __init__(self, weight: torch.nn.Parameter, *, compiled: bool = False) -> None:
        super().__init__()
        self.weight = weight
        self.compiled = compiled
        self._targets: torch.Tensor | None = None

    @contextlib.contextmanager
    def scoring(self, targets: torch.Tensor) -> Iterator[None]:
        self._targets = targets
        try:
            yield
        finally:
            self._targets = None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._targets is None:
            return F.linear(hidden, self.weight)
        targets = self._targets.reshape(-1)
        if hidden.shape[:-1].numel() != targets.numel():
            raise ValueError(f"{hidden.shape[:-1].numel()} positions scored against {targets.numel()} targets")
        return linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), self.weight, targets, compiled=self.compiled and hidden.is_cuda
        )


def install_loss_head(model: torch.nn.Module, *, compiled: bool = False) -> LossHead:
    """Replace a transformers causal LM's linear ``lm_head`` with a ``LossHead`` on the same
    weight parameter (its softmax step compiled on a GPU if ``compiled``); the new head."""
    old = model.get_output_embeddings()  # type: ignore[operator]
    if not isinstance(old, torch.nn.Linear) or old.bias is not None:
        raise TypeError(f"the model's output head is a {type(old).__name__} with a bias or not linear")
    head = LossHead(old.weight, compiled=compiled)
    model.set_output_embeddings(head)
    return head
