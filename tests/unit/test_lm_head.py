"""The causal LM's loss head (``peer.task.lm_head``): the same mean cross-entropy and gradients
as transformers' logits and ``F.cross_entropy``, chunk by chunk, on every architecture, tied
heads included; outside ``scoring`` the plain linear head."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from peer.task.causal_lm import build_lm_model, causal_lm_loss
from peer.task.lm_head import LossHead, even_chunks, linear_cross_entropy, softmax_grad
from protocol.spec import CausalLMSection
from tests.unit.lm_configs import CONFIGS, section


@pytest.mark.parametrize("rows", [1, 5, 10, 37, 1000])
def test_chunked_loss_and_gradients_equal_the_whole_batchs(rows: int) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=gen, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=gen)
    reference = F.cross_entropy(hidden @ weight.T, targets)
    grad_h, grad_w = torch.autograd.grad(reference, (hidden, weight))
    loss = linear_cross_entropy(hidden, weight, targets, rows=rows)
    got_h, got_w = torch.autograd.grad(3.0 * loss, (hidden, weight))  # the incoming gradient scales them
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(got_h, 3.0 * grad_h)
    torch.testing.assert_close(got_w, 3.0 * grad_w)
    with torch.no_grad():
        torch.testing.assert_close(linear_cross_entropy(hidden, weight, targets, rows=rows), reference)


def test_chunks_cover_every_position_once_in_near_equal_parts() -> None:
    assert even_chunks(16384, 2093) == [(i * 2048, (i + 1) * 2048) for i in range(8)]
    for n, rows in ((10, 3), (1, 5), (7, 7), (100, 1)):
        parts = even_chunks(n, rows)
        assert parts[0][0] == 0 and parts[-1][1] == n and all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        sizes = [end - start for start, end in parts]
        assert max(sizes) <= rows and max(sizes) - min(sizes) <= 1


def test_softmax_grad_is_the_loss_and_its_gradient() -> None:
    logits = torch.randn(6, 11, requires_grad=True)
    targets = torch.randint(0, 11, (6,))
    loss, grad = softmax_grad(logits.detach(), targets)
    reference = F.cross_entropy(logits, targets, reduction="sum")
    torch.testing.assert_close(loss, reference.detach())
    torch.testing.assert_close(grad, torch.autograd.grad(reference, logits)[0])


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_the_models_loss_and_gradients_equal_its_logits_cross_entropy(architecture: str) -> None:
    model = build_lm_model(section(architecture), seed=3)
    head = model.get_output_embeddings()
    assert isinstance(head, LossHead)
    if CONFIGS[architecture].get("tie_word_embeddings", architecture == "gpt2"):
        assert head.weight is model.get_input_embeddings().weight  # still tied
    plain = copy.deepcopy(model)  # the same model with transformers' linear head (tying kept)
    linear = torch.nn.Linear(1, 1, bias=False)
    linear.weight = plain.get_output_embeddings().weight
    plain.set_output_embeddings(linear)
    model.eval(), plain.eval()  # gpt2's dropout would draw differently in each
    tokens = torch.randint(0, 300, (3, 17))
    batch = (tokens[:, :-1], tokens[:, 1:])
    loss = causal_lm_loss(model, batch)
    reference = causal_lm_loss(plain, batch)  # no LossHead: transformers' logits, F.cross_entropy
    torch.testing.assert_close(loss, reference)
    loss.backward()
    reference.backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    with torch.no_grad():  # outside scoring: logits, as transformers' head gives them
        torch.testing.assert_close(model(input_ids=batch[0]).logits, plain(input_ids=batch[0]).logits)


def test_the_head_keeps_the_models_parameters_and_state_dict_keys() -> None:
    lm = CausalLMSection(architecture="llama", config=CONFIGS["llama"], seq_len=16)  # type: ignore[arg-type]
    model = build_lm_model(lm, seed=1)
    assert "lm_head.weight" in model.state_dict()
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in build_lm_model(lm, seed=1).parameters())
    head = model.get_output_embeddings()
    with pytest.raises(ValueError, match="3 positions scored against 4 targets"):
        with head.scoring(torch.zeros(4, dtype=torch.long)):
            head(torch.zeros(1, 3, 32))
    assert head._targets is None  # scoring ends even when the forward fails
