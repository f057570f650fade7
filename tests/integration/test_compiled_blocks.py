"""``task.causal_lm.compile`` (``swarmtrain peer --compile on``): the decoder blocks run through
torch.compile (here inductor's CPU backend, with the machine's C compiler) and train the same
step as eager blocks, to float tolerance: a peer's own choice of speed, never of the math."""

from __future__ import annotations

import pytest
import torch

from peer.node.inner_step import Precision, inner_optimizer, inner_step
from peer.task.base import Task
from peer.task.causal_lm import build_lm_model, causal_lm_loss
from protocol.spec import CausalLMSection, parse_spec
from tests.unit.lm_configs import CONFIGS

SPEC = """
[run]
name = "compiled"
[task]
kind = "causal_lm"
[task.causal_lm]
architecture = "llama"
seq_len = 16
[task.causal_lm.config]
vocab_size = 300
hidden_size = 32
intermediate_size = 88
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
[data]
source = "tokens"
path = "unused"
manifest = "sha256:0000000000000000000000000000000000000000000000000000000000000000"
tokenizer = "sha256:0000000000000000000000000000000000000000000000000000000000000000"
[inner]
batch_size = 4
"""


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, 300, (4, 17), generator=gen) for _ in range(3)]
    return [(r[:, :-1], r[:, 1:]) for r in rows]


def _train(compiled: bool) -> tuple[list[float], list[torch.Tensor]]:
    spec = parse_spec(SPEC)
    lm = CausalLMSection(architecture="llama", config=CONFIGS["llama"], seq_len=16, compile=compiled)  # type: ignore[arg-type]
    model = build_lm_model(lm, seed=5)
    batches = iter(_batches())
    task = Task(model, batches, causal_lm_loss, 4, 1.0)
    optimizer = inner_optimizer(spec, model)
    losses = [inner_step(model, optimizer, task, spec, round_=0, step=s, precision=Precision("cpu")) for s in range(3)]
    return losses, [p.detach().clone() for p in model.parameters()]


def test_compiled_blocks_train_the_same_steps_as_eager_ones() -> None:
    eager_losses, eager_params = _train(False)
    compiled_losses, compiled_params = _train(True)
    assert compiled_losses == pytest.approx(eager_losses, rel=1e-5)
    for a, b in zip(eager_params, compiled_params):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
