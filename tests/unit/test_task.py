"""The task layer: ByteGPT, its deterministic init, byte corpora, shards, import tasks."""

from __future__ import annotations

import hashlib
import math
import os
import subprocess
import sys
import textwrap
from itertools import islice
from pathlib import Path

import pytest
import torch

from peer.task import Task, build_task
from peer.task.bytegpt import ByteGPT, count_params
from peer.task.data import load_corpus
from protocol.errors import ConfigError
from protocol.spec import ModelSection, RunSpec, parse_spec

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = "[task.model]\nd_model = 64\nn_layers = 2\nn_heads = 4\ncontext = 64\n"


def spec_of(extra: str = "") -> RunSpec:
    return parse_spec('[run]\nname = "t"\n[inner]\nbatch_size = 4\n' + extra)


def dir_spec(path: Path, extra: str = "") -> RunSpec:
    return spec_of(f"[data]\nsource = 'dir'\npath = '{path}'\n{extra}" + DEMO_MODEL)


def params_digest(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def demo() -> Task:
    return build_task(spec_of(DEMO_MODEL), shard_seed=0)


@pytest.fixture
def text_dir(tmp_path: Path) -> Path:
    root = tmp_path / "corpus"
    (root / "sub").mkdir(parents=True)
    for i in range(6):
        (root / ("sub" if i % 2 else ".") / f"f{i}.txt").write_text(f"file {i}: " + "the quick brown fox. " * 20)
    return root


def test_forward_shapes_and_initial_loss_is_uniform(demo: Task) -> None:
    inputs, targets = next(demo.batches)
    assert inputs.shape == targets.shape == (4, 64) and inputs.dtype == targets.dtype == torch.long
    assert demo.model(inputs).shape == (4, 64, 256)
    assert demo.loss_fn(demo.model, (inputs, targets)).item() == pytest.approx(math.log(256), abs=0.1)
    assert demo.samples_per_batch == 4 and demo.flops_per_sample > 6 * count_params(demo.model.cfg) * 64


def test_init_is_deterministic_and_ignores_the_global_rng(demo: Task) -> None:
    torch.manual_seed(12345)
    rng_before = torch.get_rng_state()
    again = build_task(spec_of(DEMO_MODEL), shard_seed=7).model
    assert torch.equal(torch.get_rng_state(), rng_before)
    for (name, a), b in zip(demo.model.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b), name
    other = build_task(spec_of(DEMO_MODEL + "[data]\nseed = 1\n"), shard_seed=0).model
    assert not torch.equal(demo.model.head.weight, other.head.weight)


def test_init_is_bit_identical_in_another_process_without_simd(demo: Task) -> None:
    """The child runs torch's scalar CPU kernels (as on a CPU without AVX2), where e.g.
    ``normal_`` gives other bytes; the model's init must not."""
    code = textwrap.dedent("""
        import hashlib, sys
        from peer.task import build_task
        from protocol.spec import RunSpec
        model = build_task(RunSpec.model_validate_json(sys.argv[1]), shard_seed=3).model
        print(hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in model.parameters())).hexdigest())
    """)
    argv = [sys.executable, "-c", code, spec_of(DEMO_MODEL).model_dump_json()]
    env = {**os.environ, "ATEN_CPU_CAPABILITY": "default"}
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == params_digest(demo.model)


def test_shard_seeds_pick_windows_reproducibly(text_dir: Path) -> None:
    spec = dir_spec(text_dir)
    first = list(islice(build_task(spec, shard_seed=1).batches, 3))
    again = list(islice(build_task(spec, shard_seed=1).batches, 3))
    other = list(islice(build_task(spec, shard_seed=2).batches, 3))
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(first, again))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(first, other))


def test_targets_are_inputs_shifted_by_one(demo: Task) -> None:
    inputs, targets = next(demo.batches)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert int(inputs.min()) >= 0 and int(inputs.max()) < 256


def test_adamw_steps_reduce_the_loss_of_a_batch() -> None:
    task = build_task(spec_of(DEMO_MODEL), shard_seed=0)
    batch = next(task.batches)
    opt = torch.optim.AdamW(task.model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        loss = task.loss_fn(task.model, batch)
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0] - 0.5


def test_stdlib_corpus_loads_with_held_out_files() -> None:
    corpus = load_corpus(spec_of().data, context=128)
    assert corpus.train.numel() > 1_000_000 and corpus.train.dtype == torch.uint8
    assert corpus.val_files >= 1 and corpus.val.numel() > 0
    assert b"def " in bytes(corpus.train[:100_000].tolist())
    capped = load_corpus(spec_of().data, context=128, max_bytes=100_000)
    assert capped.train.numel() + capped.val.numel() == 100_000


def test_eval_batches_are_fixed_and_shared_by_all_peers(demo: Task) -> None:
    assert demo.eval_batches is not None
    other = build_task(spec_of(DEMO_MODEL), shard_seed=9)
    assert other.eval_batches is not None
    a, b, c = list(demo.eval_batches()), list(demo.eval_batches()), list(other.eval_batches())
    assert len(a) > 0 and all(torch.equal(x[0], y[0]) and torch.equal(x[0], z[0]) for x, y, z in zip(a, b, c))


@pytest.mark.parametrize("case", ["missing", "empty", "file", "tiny"])
def test_dir_source_errors_name_the_path(tmp_path: Path, case: str) -> None:
    path = tmp_path / "data"
    if case == "empty":
        path.mkdir()
    elif case == "file":
        path.write_text("x")
    elif case == "tiny":
        path.mkdir()
        (path / "a.txt").write_text("too short")
    with pytest.raises(ConfigError, match=str(path)):
        build_task(dir_spec(path), shard_seed=0)


def test_dir_source_trains_on_its_text_and_splits_files_by_shard(text_dir: Path) -> None:
    spec = dir_spec(text_dir, "validation_fraction = 0.2\n")
    task = build_task(spec, shard_seed=0)
    inputs, _ = next(task.batches)
    assert set(bytes(inputs.flatten().tolist())) <= set(b"file 0123456789: thequickbrownfox.")
    full = load_corpus(spec.data, context=64)
    halves = [load_corpus(spec.data, context=64, num_shards=2, shard_index=i) for i in range(2)]
    assert full.val_files == 1 and full.train_files == 5
    assert [h.train_files for h in halves] == [3, 2]
    assert sum(h.train.numel() for h in halves) == full.train.numel()
    assert torch.equal(halves[0].val, full.val)
    with pytest.raises(ConfigError, match="shard_index"):
        load_corpus(spec.data, context=64, num_shards=2, shard_index=2)


FACTORY_MODULE = """
import itertools
import torch
from peer.task import Task

def make(*, spec, shard_seed, device, width=2):
    model = torch.nn.Linear(width, 1).to(device)
    batch = (torch.full((3, width), float(shard_seed)), torch.zeros(3, 1))
    loss = lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1])
    return Task(model=model, batches=itertools.repeat(batch), loss_fn=loss,
                samples_per_batch=3, flops_per_sample=6.0 * width)

def not_a_task(**kwargs):
    return 42

NOT_CALLABLE = 1
"""


def import_spec(factory: str, options: str = "") -> RunSpec:
    return spec_of(f"[task]\nkind = 'import'\nfactory = '{factory}'\n[task.options]\n{options}")


def test_import_task_calls_the_factory_with_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_tasks.py").write_text(FACTORY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    task = build_task(import_spec("my_tasks:make", "width = 5"), shard_seed=4)
    inputs, _ = next(task.batches)
    assert task.model.in_features == 5 and inputs[0, 0].item() == 4.0
    assert task.loss_fn(task.model, next(task.batches)).ndim == 0


@pytest.mark.parametrize(
    "factory, options",
    [
        ("no_such_module_xyz:make", ""),
        ("my_tasks:missing", ""),
        ("my_tasks:NOT_CALLABLE", ""),
        ("my_tasks:not_a_task", ""),
        ("my_tasks:make", "device = 'cuda'"),
    ],
)
def test_bad_import_task_is_a_config_error_naming_the_factory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, factory: str, options: str
) -> None:
    (tmp_path / "my_tasks.py").write_text(FACTORY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=factory):
        build_task(import_spec(factory, options), shard_seed=0)


@pytest.mark.parametrize(
    "cfg, low, high",
    [
        (ModelSection(d_model=64, n_layers=2, n_heads=4, context=64), 100_000, 1_000_000),
        (ModelSection(d_model=768, n_layers=12, n_heads=12, context=1024), 80_000_000, 130_000_000),
    ],
)
def test_param_count_matches_the_model(cfg: ModelSection, low: int, high: int) -> None:
    model = ByteGPT(cfg, device="meta")
    assert sum(p.numel() for p in model.parameters()) == count_params(cfg)
    assert low <= count_params(cfg) <= high
