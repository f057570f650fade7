"""The inner steps' gradients in the averager's vector (``peer.round.grad_home``)."""

from __future__ import annotations

import multiprocessing as mp
import threading
from types import SimpleNamespace

import torch

from peer.round.grad_home import GradHome, gradients_fit
from peer.round.state import flatten
from peer.round.swarm_port import LentOutbox
from peer.swarm.swarm import lend


def model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def numel(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


class Port:
    """Lends one vector, or nothing while ``busy``; counts releases."""

    def __init__(self, n: int) -> None:
        self.vector = torch.full((n,), float("nan"))
        self.busy = False
        self.released = 0

    def lend_outbox(self) -> LentOutbox | None:
        if self.busy:
            return None
        self.busy = True

        def release() -> None:
            self.busy = False
            self.released += 1

        return LentOutbox(self.vector, release)


def steps(m: torch.nn.Module, home: GradHome | None, micro: int = 3) -> None:
    """Three AdamW steps of ``micro`` micro-batches each, gradients where ``home`` keeps them."""
    optimizer = torch.optim.AdamW(m.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        keep = home.bind(m) if home is not None else False
        optimizer.zero_grad(set_to_none=not keep)
        for _ in range(micro):
            x = torch.randn(5, 8, generator=gen)
            (m(x).square().mean() / micro).backward()
        optimizer.step()


def test_gradients_in_the_vector_train_bit_for_bit_as_gradients_of_their_own() -> None:
    own, lent = model(), model()
    port = Port(numel(lent))
    home = GradHome(port, enabled=True)
    steps(own, None)
    steps(lent, home)
    assert home.bound and port.busy
    assert torch.equal(flatten(own), flatten(lent))
    # backward accumulated in the vector itself: the gradients are views of it, in flatten order
    offset = 0
    for p in lent.parameters():
        assert p.grad is not None and p.grad.data_ptr() == port.vector[offset:].data_ptr()
        offset += p.numel()
    assert torch.equal(port.vector, torch.cat([p.grad.view(-1) for p in own.parameters()]))
    home.release(lent)
    home.release(lent)  # once
    assert port.released == 1 and not port.busy and not home.bound
    assert all(p.grad is None for p in lent.parameters())


def test_a_vector_held_by_a_round_leaves_the_gradients_their_own_memory() -> None:
    m = model()
    port = Port(numel(m))
    port.busy = True  # a round averages it
    home = GradHome(port, enabled=True)
    steps(m, home)
    assert not home.bound
    assert all(p.grad is not None and p.grad.data_ptr() != port.vector.data_ptr() for p in m.parameters())
    assert torch.isnan(port.vector).all()  # untouched


def test_a_model_that_does_not_match_the_vector_is_never_bound() -> None:
    m = model()
    port = Port(numel(m) + 1)
    home = GradHome(port, enabled=True)
    assert not home.bind(m) and not home.enabled and not port.busy
    assert not gradients_fit(m.to(torch.float64), numel(m))
    disabled = GradHome(Port(numel(m)), enabled=False)  # overlap, an accelerator, ranks
    assert not disabled.bind(model())


def test_lending_holds_the_averagers_lock_until_released() -> None:
    averager = SimpleNamespace(lock_averaged_tensors=mp.Lock(), vector=torch.zeros(4))
    first = lend(averager)  # type: ignore[arg-type]
    assert first is not None and first.vector is averager.vector
    assert lend(averager) is None  # type: ignore[arg-type]
    entered = threading.Event()

    def averaging() -> None:  # a round's all-reduce takes the same lock (``get_tensors``)
        with averager.lock_averaged_tensors:
            entered.set()

    round_ = threading.Thread(target=averaging)
    round_.start()
    assert not entered.wait(0.2)  # it waits for the release
    first.release()
    first.release()  # once: a second call must not release a lock someone else holds now
    assert entered.wait(10)
    round_.join(10)
    again = lend(averager)  # type: ignore[arg-type]
    assert again is not None
    again.release()


def test_a_frozen_parameter_gets_no_gradient_to_be_stepped_with() -> None:
    own, lent = model(), model()
    for m in (own, lent):
        m[0].bias.requires_grad_(False)
    home = GradHome(Port(numel(lent)), enabled=True)
    steps(own, None)
    steps(lent, home)
    assert home.bound and lent[0].bias.grad is None
    assert torch.equal(flatten(own), flatten(lent))  # AdamW (weight decay) left it where it was
    assert torch.equal(lent[0].bias, model()[0].bias)
