from __future__ import annotations

from pathlib import Path

import pydantic
import pytest

from protocol.errors import SpecError
from protocol.identity import Identity
from protocol.spec import RunSpec, load_spec, parse_spec

REPO = Path(__file__).resolve().parents[2]
SHIPPED = sorted(REPO.glob("examples/**/*.toml")) + sorted(REPO.glob("benchmarks/**/*.toml"))

MINIMAL = '[run]\nname = "t"\n'


def problems(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_spec(text, source="s.toml")
    return info.value.problems


def test_there_are_shipped_specs() -> None:
    assert any(p.name == "demo.toml" for p in SHIPPED)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: str(p.relative_to(REPO)))
def test_every_shipped_spec_parses(path: Path) -> None:
    spec = load_spec(path)
    assert spec.digest().startswith("sha256:") and len(spec.digest()) == 7 + 64


def test_defaults_fill_in() -> None:
    spec = parse_spec(MINIMAL)
    assert spec.outer.lr == 0.7 and spec.outer.momentum == 0.9 and spec.outer.nesterov
    assert spec.rounds.inner_steps == 50
    assert spec.averaging.compression == "fp16"


def test_digest_ignores_formatting_comments_order_and_spelled_out_defaults() -> None:
    a = parse_spec('[run]\nname = "t"\n[outer]\nlr = 0.5\nmomentum = 0.8\n')
    b = parse_spec('# comment\n[outer]\nmomentum = 0.8   # m\nlr     = 0.5\nnesterov = true\n[run]\nname="t"\n')
    assert a.digest() == b.digest()


def test_digest_changes_with_any_training_value() -> None:
    base = parse_spec(MINIMAL).digest()
    assert parse_spec(MINIMAL + "[outer]\nlr = 0.71\n").digest() != base
    assert parse_spec(MINIMAL + "[averaging]\ncompression = 'int8'\n").digest() != base
    assert parse_spec('[run]\nname = "u"\n').digest() != base


def test_digest_excludes_admission_policy() -> None:
    key = Identity.generate().public_key.id
    listed = parse_spec(MINIMAL + f"[admission]\nmode = 'allowlist'\nallowlist = ['{key}']\n")
    assert listed.digest() == parse_spec(MINIMAL).digest()


def test_int_is_accepted_for_float_but_strings_are_not_coerced() -> None:
    assert parse_spec(MINIMAL + "[outer]\nlr = 1\n").outer.lr == 1.0
    (problem,) = problems(MINIMAL + '[rounds]\ninner_steps = "10"\n')
    assert "rounds.inner_steps" in problem and "line 4" in problem and "integer" in problem


def test_wrong_type_names_field_and_line() -> None:
    (problem,) = problems(MINIMAL + "[inner]\nbatch_size = 1.5\n")
    assert problem.startswith("line 4: inner.batch_size:")


def test_unknown_key_is_rejected_with_suggestion() -> None:
    (problem,) = problems(MINIMAL + "[rounds]\ninner_step = 10\n")
    assert "rounds.inner_step: unknown key" in problem and "'inner_steps'" in problem and "line 4" in problem


def test_unknown_table_is_rejected() -> None:
    (problem,) = problems(MINIMAL + "[optimiser]\nlr = 1\n")
    assert "optimiser: unknown key" in problem and "line 3" in problem


def test_broken_toml_names_line() -> None:
    (problem,) = problems('[run]\nname = "t"\n[rounds\n')
    assert "TOML syntax error" in problem and "line 3" in problem


def test_missing_run_table() -> None:
    (problem,) = problems("")
    assert problem == "run: required key is missing"


def test_every_problem_is_reported_on_its_own_line() -> None:
    found = problems(MINIMAL + "[averaging]\ncompression = 'zstd'\n[inner]\nlr = -1\n")
    assert len(found) == 2 and all("\n" not in p for p in found)
    assert any("averaging.compression" in p for p in found) and any("inner.lr" in p for p in found)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("[task.model]\nd_model = 65\n", "must divide"),
        ("[task]\nkind = 'import'\n", "needs factory"),
        ("[task]\nfactory = 'a.b:c'\n", "only used with kind = 'import'"),
        ("[task]\nkind = 'import'\nfactory = 'not a path'\n", "task.factory"),
        ("[data]\nsource = 'dir'\n", "needs path"),
        ("[rounds]\ninner_steps = 0\n", "rounds.inner_steps"),
        ("[averaging]\ntarget_group_size = 4\n", "target_group_size was retired"),
        ("[averaging]\nclip = 0.5\n", "use 0 (off) or >= 1"),
        ("[averaging]\nweight_cap = -1\n", "averaging.weight_cap"),
        ("[averaging]\nstreams = 0\n", "averaging.streams"),
        ("[outer]\nmomentum = 0.0\n", "needs momentum > 0"),
        ("[outer]\nmomentum = 1.0\n", "outer.momentum"),
        ("[inner]\nbetas = [0.9]\n", "inner.betas"),
        ("[inner]\nlr = nan\n", "inner.lr"),
        ("[admission]\nallowlist = ['nope']\n", "must start with 'ed25519:'"),
        ("[admission]\nmode = 'allowlist'\nallowlist = ['ed25519:AAAA']\n", "32-byte key"),
        ("[run.extra]\nx = 1\n", "run.extra"),
        ("spec_version = 2\n", "spec_version"),
    ],
)
def test_invalid_values_are_named(extra: str, needle: str) -> None:
    text = extra + MINIMAL if extra.startswith("spec_version") else MINIMAL + extra
    assert any(needle in p for p in problems(text)), problems(text)


def test_rounds_need_a_bound() -> None:
    found = problems(MINIMAL + "[rounds]\ninner_steps = 0\n")
    assert found
    spec = parse_spec(MINIMAL + "[rounds]\ntime_budget_s = 30.0\ninner_steps = 5\n")
    assert spec.rounds.time_budget_s == 30.0
    budget_only = parse_spec(MINIMAL + "[rounds]\ntime_budget_s = 30.0\n")
    assert budget_only.rounds.inner_steps is None
    assert parse_spec(MINIMAL + "[rounds]\nmax_rounds = 3\n").rounds.inner_steps == 50


def test_allowlist_in_open_mode_is_an_error() -> None:
    key = Identity.generate().public_key.id
    (problem,) = problems(MINIMAL + f"[admission]\nallowlist = ['{key}']\n")
    assert "set mode = 'allowlist'" in problem


def test_load_spec_file_errors(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "missing.toml")
    with pytest.raises(SpecError, match="is a directory"):
        load_spec(tmp_path)
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'[run]\nname = "\xe9"\n')
    with pytest.raises(SpecError, match="not UTF-8"):
        load_spec(bad)


def test_spec_is_immutable() -> None:
    spec = parse_spec(MINIMAL)
    with pytest.raises(pydantic.ValidationError):
        spec.outer.lr = 1.0  # type: ignore[misc]
    assert isinstance(spec, RunSpec)


def test_a_token_run_names_where_its_data_is_published() -> None:
    base = (
        "[run]\nname='lm'\n[task]\nkind='causal_lm'\n[task.causal_lm]\narchitecture='llama'\nseq_len=16\n"
        "[task.causal_lm.config]\nvocab_size=300\nhidden_size=32\nintermediate_size=88\nnum_hidden_layers=2\n"
        "num_attention_heads=4\nnum_key_value_heads=2\n[rounds]\ninner_steps=2\n"
        "[data]\nsource='tokens'\nmanifest='sha256:" + "0" * 64 + "'\ntokenizer='sha256:" + "0" * 64 + "'\n"
    )
    for url in ("https://data.example.org/run-1/", "http://10.0.0.2:8090/", "hf://datasets/org/name@v1/prepared"):
        spec = parse_spec(base + f"url='{url}'\n")
        assert spec.data.url == url and spec.data.path is None  # the url alone is enough
    with pytest.raises(SpecError, match="needs manifest, tokenizer .* and path or url"):
        parse_spec(base)
    for bad in ("ftp://host/x", "file:///etc/", "https://host/ spaced", "hf://models/org/name"):
        with pytest.raises(SpecError, match="data.url"):
            parse_spec(base + f"url='{bad}'\n")
    with pytest.raises(SpecError, match="url is only used with source = 'tokens'"):
        parse_spec("[run]\nname='x'\n[data]\nurl='https://host/'\n")
    # where the data is published is not the run: its bytes are pinned by the manifest's digest
    assert parse_spec(base + "url='https://a/'\n").digest() == parse_spec(base + "url='https://b/'\n").digest()
