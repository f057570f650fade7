"""The causal-LM task's model: transformers' architectures at the size the formula says,
initialised bit-identically from the seed alone; micro-batches add up to the whole batch."""

from __future__ import annotations

import pytest
import torch

from peer.inner_step import Precision, inner_optimizer, inner_step
from peer.task.base import Task
from peer.task.causal_lm import build_lm_model, causal_lm_loss
from protocol.errors import SpecError
from protocol.modelsize import lm_flops_per_sample, lm_shape
from protocol.spec import CausalLMSection, parse_spec

CONFIGS = {
    "llama": {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 88, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2},
    "mistral": {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 1},
    "qwen2": {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True},
    "gpt2": {"vocab_size": 300, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64},
}  # fmt: skip


def section(architecture: str) -> CausalLMSection:
    return CausalLMSection(architecture=architecture, config=CONFIGS[architecture], seq_len=16)  # type: ignore[arg-type]


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


def test_portable_normal_draws_in_chunks_the_same_bytes_as_in_one_go(monkeypatch: pytest.MonkeyPatch) -> None:
    import math

    import peer.task.portable_init as portable

    def in_one_go(tensor: torch.Tensor, std: float, gen: torch.Generator) -> None:
        u = torch.rand((4, *tensor.shape), generator=gen, dtype=torch.float32)
        tensor.copy_(((((u[0] + u[1]) + u[2]) + u[3]) - 2.0) * (std * math.sqrt(3.0)))

    monkeypatch.setattr(portable, "_CHUNK", 1000)
    for shape in ((3,), (64, 64), (1001,), (5000, 3)):
        expected, got = torch.empty(shape), torch.empty(shape)
        g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
        in_one_go(expected, 0.02, g1)
        portable.portable_normal_(got, 0.02, g2)
        assert torch.equal(expected, got)
        assert torch.equal(torch.rand(3, generator=g1), torch.rand(3, generator=g2))  # same stream position


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
