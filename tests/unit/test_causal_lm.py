"""The causal-LM task's model: transformers' architectures at the size the formula says,
initialised bit-identically from the seed alone; micro-batches add up to the whole batch."""

from __future__ import annotations

import pytest
import torch

from peer.node.inner_step import Precision, inner_optimizer, inner_step
from peer.task.base import Task
from peer.task.causal_lm import build_lm_model, causal_lm_loss
from protocol.errors import SpecError
from protocol.lm_shape import lm_flops_per_sample, lm_shape
from protocol.spec import CausalLMSection, parse_spec
from tests.unit.lm_configs import CONFIGS, section


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_every_architecture_builds_at_the_formulas_size_and_the_same_bytes_from_the_seed(architecture: str) -> None:
    lm = section(architecture)
    torch.manual_seed(1)
    first = build_lm_model(lm, seed=42)
    torch.manual_seed(2)  # the global RNG plays no part
    again = build_lm_model(lm, seed=42)
    other = build_lm_model(lm, seed=43)
    params = list(first.parameters())
    assert sum(p.numel() for p in params) == lm_shape(architecture, lm.config).params
    assert all(p.dtype == torch.float32 for p in params)  # fp32 masters
    for a, b in zip(first.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    assert any(not torch.equal(a, b) for a, b in zip(first.parameters(), other.parameters()))
    tokens = torch.randint(0, 300, (2, 17))
    loss = causal_lm_loss(first, (tokens[:, :-1], tokens[:, 1:]))
    assert abs(float(loss.detach()) - torch.log(torch.tensor(300.0)).item()) < 0.5  # a fresh model: about ln(vocab)


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_skipping_transformers_init_builds_the_same_model(architecture: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The build skips transformers' random init (``portable_init_`` overwrites every parameter):
    the result must equal a model built with it, buffers (rotary frequencies) and tied heads
    included."""
    import contextlib

    from peer.task import causal_lm

    lm = section(architecture)
    fast = build_lm_model(lm, seed=7)
    monkeypatch.setattr(causal_lm, "_skip_transformers_init", contextlib.nullcontext)
    slow = build_lm_model(lm, seed=7)
    fast_state, slow_state = fast.state_dict(), slow.state_dict()
    assert list(fast_state) == list(slow_state)
    for name, value in slow_state.items():
        assert torch.equal(fast_state[name], value), name
    fast_buffers, slow_buffers = dict(fast.named_buffers()), dict(slow.named_buffers())
    assert list(fast_buffers) == list(slow_buffers)
    for name, value in slow_buffers.items():  # non-persistent ones too (not in the state dict)
        assert torch.equal(fast_buffers[name], value), name
    tied = lambda m: {n for n, _ in m.named_parameters(remove_duplicate=False)} - {n for n, _ in m.named_parameters()}  # noqa: E731
    assert tied(fast) == tied(slow)


def test_flops_count_matmuls_and_attention() -> None:
    shape = lm_shape("llama", CONFIGS["llama"])
    matmul = shape.params - shape.embedding
    assert lm_flops_per_sample(shape, 16) == 6 * matmul * 16 + 12 * 2 * 32 * 16 * 16


def test_micro_batches_give_the_whole_batchs_step() -> None:
    spec = parse_spec(
        "[run]\nname='mb'\n[inner]\nbatch_size=8\noptimizer='sgd'\nweight_decay=0.0\ngrad_clip=0.0\nlr=0.1\n"
    )
    tokens = torch.randint(0, 300, (8, 17))
    batch = (tokens[:, :-1], tokens[:, 1:])
    results = []
    for micro in (1, 4):
        model = build_lm_model(section("llama"), seed=7)
        task = Task(model=model, batches=iter([batch]), loss_fn=causal_lm_loss, samples_per_batch=8,
                    flops_per_sample=1.0, micro_batches=micro)  # fmt: skip
        optimizer = inner_optimizer(spec, model)
        loss = inner_step(model, optimizer, task, spec, round_=0, step=0, precision=Precision("cpu"))
        results.append((loss, torch.cat([p.detach().flatten() for p in model.parameters()])))
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-5)
    assert torch.allclose(results[0][1], results[1][1], atol=1e-6)


def test_the_spec_refuses_what_the_formula_cannot_size() -> None:
    base = "[run]\nname='lm'\n[task]\nkind='causal_lm'\n[task.causal_lm]\narchitecture='llama'\nseq_len=16\n"
    data = (
        "[data]\nsource='tokens'\npath='d'\nmanifest='sha256:" + "0" * 64 + "'\ntokenizer='sha256:" + "0" * 64 + "'\n"
        "[rounds]\ninner_steps=2\n"
    )
    with pytest.raises(SpecError, match="config.hidden_size is required"):
        parse_spec(base + "[task.causal_lm.config]\nvocab_size=10\n" + data)
    cfg = "".join(f"{k}={v}\n" for k, v in CONFIGS["llama"].items())
    with pytest.raises(SpecError, match="seq_len .* exceeds"):
        parse_spec(base.replace("seq_len=16", "seq_len=512") + "[task.causal_lm.config]\n" + cfg
                   + "max_position_embeddings=128\n" + data)  # fmt: skip
    with pytest.raises(SpecError, match="trains on prepared tokens"):
        parse_spec(base + "[task.causal_lm.config]\n" + cfg)
    with pytest.raises(SpecError, match="needs rounds.inner_steps"):
        parse_spec(base + "[task.causal_lm.config]\n" + cfg + data.replace("inner_steps=2", "time_budget_s=5.0"))
    with pytest.raises(SpecError, match="micro_batches .* must divide"):
        parse_spec(base + "micro_batches=3\n[task.causal_lm.config]\n" + cfg + data)
    spec = parse_spec(base + "[task.causal_lm.config]\n" + cfg + data)
    assert spec.sequence_length() == 16


def test_portable_normal_is_the_formula_per_block_whatever_the_thread_count(monkeypatch: pytest.MonkeyPatch) -> None:
    import math

    import peer.task.portable_init as portable

    def reference(n: int, std: float, seed: int) -> torch.Tensor:
        """Block by block: 4 uniforms per value from the block's own generator, summed in order."""
        out = []
        for i, start in enumerate(range(0, n, portable._BLOCK)):
            size = min(portable._BLOCK, n - start)
            gen = torch.Generator().manual_seed(portable._derive(seed, "block", i))
            u = torch.rand((4, size), generator=gen, dtype=torch.float32)
            out.append(((((u[0] + u[1]) + u[2]) + u[3]) - 2.0) * (std * math.sqrt(3.0)))
        return torch.cat(out)

    monkeypatch.setattr(portable, "_BLOCK", 1000)
    for shape in ((3,), (64, 64), (1001,), (5000, 3)):
        expected = reference(math.prod(shape), 0.02, 9).view(shape)
        for workers in (1, 2, 3):
            got = torch.empty(shape)
            portable.portable_normal_(got, 0.02, 9, workers=workers)
            assert torch.equal(expected, got), (shape, workers)
    short, long = torch.empty(2500), torch.empty(4000)
    portable.portable_normal_(short, 0.02, 9)
    portable.portable_normal_(long, 0.02, 9)
    assert torch.equal(short[:2000], long[:2000])  # a whole block depends on (seed, block) alone
    other = torch.empty(2500)
    portable.portable_normal_(other, 0.02, 10)
    assert not torch.equal(short, other)
    big = torch.nn.Parameter(torch.empty(200_000))  # a parameter (requires grad), drawn on 2 threads
    portable.portable_normal_(big, 0.02, 1, workers=2)
    assert big.requires_grad and big.grad_fn is None
    values = big.detach()
    assert abs(float(values.std()) - 0.02) < 0.0005 and abs(float(values.mean())) < 0.0005
    assert float(values.abs().max()) <= 2 * math.sqrt(3.0) * 0.02


def test_continued_pretraining_starts_every_peer_from_the_named_weights(tmp_path: pytest.TempPathFactory) -> None:
    from pathlib import Path

    from safetensors.torch import save_file

    from protocol.errors import ConfigError
    from protocol.manifest import weights_sha256

    base = section("qwen2")  # tied output head: absent from the files, as in released checkpoints
    released = build_lm_model(base, seed=5)
    directory = Path(str(tmp_path)) / "weights"
    directory.mkdir()
    tensors = {name: p.detach().to(torch.bfloat16).contiguous() for name, p in released.named_parameters()}
    assert "lm_head.weight" not in tensors
    save_file(tensors, str(directory / "model.safetensors"))
    digest = weights_sha256(directory)
    lm = base.model_copy(update={"weights_path": str(directory), "weights": digest})
    loaded = build_lm_model(lm, seed=999)  # the seed plays no part now
    for name, param in loaded.named_parameters():
        assert param.dtype == torch.float32
        assert torch.equal(param, tensors[name].float()), name
    assert torch.equal(loaded.lm_head.weight, loaded.model.embed_tokens.weight)
    wrong = lm.model_copy(update={"weights": "sha256:" + "1" * 64})
    with pytest.raises(ConfigError, match="weights mismatch"):
        build_lm_model(wrong, seed=0)
    other = section("llama").model_copy(update={"weights_path": str(directory), "weights": digest})
    with pytest.raises(ConfigError, match="do not fit the spec's llama"):
        build_lm_model(other, seed=0)
    untied = directory.parent / "untied"
    untied.mkdir()
    save_file({**tensors, "lm_head.weight": torch.zeros_like(tensors["model.embed_tokens.weight"])},
              str(untied / "model.safetensors"))  # fmt: skip
    split = base.model_copy(update={"weights_path": str(untied), "weights": weights_sha256(untied)})
    with pytest.raises(ConfigError, match="hold different .* but the spec ties them"):
        build_lm_model(split, seed=0)


def test_a_config_may_not_change_precision_or_attention() -> None:
    with pytest.raises(ValueError, match="config may not set \\['torch_dtype'\\]"):
        CausalLMSection(architecture="llama", config={**CONFIGS["llama"], "torch_dtype": "bfloat16"}, seq_len=16)  # type: ignore[arg-type]
