"""``export_model``: a run's flat state as a transformers model directory that loads with
``AutoModelForCausalLM``/``AutoTokenizer``, computes what the run's model computes, and generates;
bad input (a wrong tokenizer, another run's state, a used directory) is refused and writes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peer.export import PROVENANCE, byte_tokenizer, export_model
from peer.round.state import flatten
from peer.task.bytegpt import build_model
from peer.task.causal_lm import build_lm_model, causal_lm_loss
from protocol.errors import ConfigError
from protocol.manifest import tokenizer_sha256
from protocol.spec import RunSpec, parse_spec
from tests.specs import ZERO_DIGEST, bare_spec, llama_task, token_data

LLAMA = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 88, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE of 300 tokens, trained the way `swarmtrain data tokenizer` trains one."""
    from swarmtrain.dataprep import train_tokenizer

    root = tmp_path_factory.mktemp("tok")
    text = root / "text.txt"
    text.write_text("the swarm trains one model together, round after round.\n" * 200, encoding="utf-8")
    train_tokenizer([text], root / "tokenizer", vocab_size=300)
    return root / "tokenizer"


def llama_spec(tokenizer: Path) -> RunSpec:
    data = token_data(path=str(tokenizer), manifest=ZERO_DIGEST, tokenizer=tokenizer_sha256(tokenizer))
    return parse_spec(
        bare_spec(
            "lm-export",
            task=llama_task(**LLAMA),
            batch_size=None,
            inner_steps=2,
            sections=data,
        )
    )


BYTE_SPEC = bare_spec(
    "bytes",
    n_layers=2,
    batch_size=None,
    inner_steps=None,
)


def test_a_causal_lm_exports_with_its_weights_and_tokenizer_and_generates(tokenizer: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = llama_spec(tokenizer)
    trained = build_lm_model(spec.task.causal_lm, seed=5)  # type: ignore[arg-type]
    params = flatten(trained)
    out = tmp_path / "model"
    record = export_model(spec, params, out, round_=12, state_digest="sha256:" + "ab" * 32)
    assert record.round == 12 and record.parameters == params.numel() and record.architecture == "llama"
    assert (out / "model.safetensors").is_file() and (out / PROVENANCE).is_file()
    model = AutoModelForCausalLM.from_pretrained(str(out))
    loaded = dict(model.named_parameters())
    for name, value in trained.named_parameters():  # the training module's names, the flat state's values
        assert torch.equal(loaded[name], value.detach()), name
    tokens = torch.randint(0, 300, (2, 17))
    batch = (tokens[:, :-1], tokens[:, 1:])
    logits = model(input_ids=batch[0]).logits
    ours = causal_lm_loss(trained, batch)
    theirs = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())
    assert float(theirs.detach()) == pytest.approx(float(ours.detach()), rel=1e-5)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token_id == 0 and model.config.eos_token_id == 0
    prompt = tok("the swarm", return_tensors="pt")
    generated = model.generate(**prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert generated.shape[1] == prompt["input_ids"].shape[1] + 6
    assert isinstance(tok.decode(generated[0]), str)


def test_the_byte_model_exports_as_a_gpt2_that_computes_the_same_logits(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = parse_spec(BYTE_SPEC)
    trained = build_model(spec.task.model, seed=3).eval()
    out = tmp_path / "byte-model"
    export_model(spec, flatten(trained), out, round_=4, state_digest="sha256:" + "cd" * 32)
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert model.config.model_type == "gpt2" and model.config.vocab_size == 256
    text = "héllo, swarm"
    tok = AutoTokenizer.from_pretrained(str(out))
    ids = tok(text, return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == list(text.encode("utf-8"))  # ids are the bytes
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids).logits, trained(ids), atol=1e-5)
    generated = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 5
    assert tok.decode(ids[0]) == text


def test_the_byte_tokenizer_maps_every_byte_to_itself() -> None:
    tok = byte_tokenizer()
    everything = bytes(range(256))
    ids = tok(everything.decode("latin-1").encode("utf-8").decode("utf-8"), add_special_tokens=False)["input_ids"]
    assert ids == list(everything.decode("latin-1").encode("utf-8"))
    assert len(tok) == 256


def test_bad_exports_are_refused_and_write_nothing(tokenizer: Path, tmp_path: Path) -> None:
    spec = llama_spec(tokenizer)
    params = flatten(build_lm_model(spec.task.causal_lm, seed=5))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="the state holds .* values, the spec's model"):
        export_model(spec, params[:-1], tmp_path / "short", round_=1, state_digest="x")
    other = tmp_path / "other-tokenizer"
    other.mkdir()
    (other / "tokenizer.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ConfigError, match="tokenizer mismatch"):
        export_model(spec, params, tmp_path / "wrong-tok", round_=1, state_digest="x", tokenizer_dir=other)
    used = tmp_path / "used"
    used.mkdir()
    (used / "keep.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(ConfigError, match="not an empty directory"):
        export_model(spec, params, used, round_=1, state_digest="x")
    imported = parse_spec("[run]\nname='x'\n[task]\nkind='import'\nfactory='my.module:build'\n")
    with pytest.raises(ConfigError, match="its model is your own code"):
        export_model(imported, params, tmp_path / "imp", round_=1, state_digest="x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other-tokenizer", "used"]
    assert [p.name for p in used.iterdir()] == ["keep.txt"]


def _checkpoint(directory: Path, spec: RunSpec, round_: int, *, carry: bool = True) -> Path:
    from engine.checkpoint import Checkpointer

    params = flatten(build_model(spec.task.model, seed=round_))
    saver = Checkpointer(directory, spec_digest=spec.digest(), keep=5, spec=spec if carry else None)
    return saver.save({"round": round_, "params": params, "momentum": torch.zeros_like(params)})


def test_a_checkpoint_carries_its_spec_and_export_needs_nothing_else(tmp_path: Path) -> None:
    from engine.checkpoint import checkpoint_spec, read_checkpoint

    spec = parse_spec(BYTE_SPEC)
    _checkpoint(tmp_path, spec, 3)
    newest = _checkpoint(tmp_path, spec, 4)
    record = read_checkpoint(tmp_path)  # the directory: its newest that verifies
    assert record["round"] == 4 and checkpoint_spec(record) == spec
    assert checkpoint_spec(record).digest() == spec.digest()  # type: ignore[union-attr]
    # an edited spec inside is refused (the digest it names is the run's)
    loaded = torch.load(newest, weights_only=True)
    loaded["spec_json"] = loaded["spec_json"].replace('"d_model":32', '"d_model":64')
    torch.save(loaded, newest)
    with pytest.raises(ConfigError, match="round-000000004.pt: the spec it carries is not the run it names"):
        read_checkpoint(newest)
    assert read_checkpoint(tmp_path)["round"] == 3  # the directory falls back to the one before
    # one written before checkpoints carried their spec: the caller names the run
    older = tmp_path / "older"
    _checkpoint(older, spec, 7, carry=False)
    with pytest.raises(ConfigError, match="carries no run spec .*: pass the run's --spec"):
        read_checkpoint(older)
    assert read_checkpoint(older, spec_digest=spec.digest())["round"] == 7
    with pytest.raises(ConfigError, match="made for another run"):
        read_checkpoint(older, spec_digest=parse_spec(BYTE_SPEC.replace("bytes", "other")).digest())
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="junk.pt: not a readable checkpoint"):
        read_checkpoint(tmp_path / "junk.pt")
