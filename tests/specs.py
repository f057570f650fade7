"""The tests' run specs, all from one builder (``tiny_spec``): by default a tiny byte-level GPT
that trains in seconds on a CPU, with timeouts short enough for a test and long enough for a
loaded machine; a causal LM on prepared tokens with ``task=llama_task(...)`` and
``sections=token_data(...)``. A value given as a string is written as is, so a spec may hold
``str.format`` fields for the test to fill (``{codec}``); quote TOML strings (``'"sgd"'``).
Specs that a test writes wrong on purpose (the parser's own tests) are the only ones written
by hand."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

Value = str | int | float | bool


def _value(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _lines(keys: Mapping[str, Value | None]) -> list[str]:
    return [f"{key} = {_value(value)}" for key, value in keys.items() if value is not None]


def llama_task(*, seq_len: int = 16, micro_batches: int | None = None, **config: Value) -> dict[str, dict[str, Value]]:
    """``tiny_spec``'s ``task`` for a Llama (``config``: its ``task.causal_lm.config``)."""
    causal_lm: dict[str, Value] = {"architecture": '"llama"', "seq_len": seq_len}
    if micro_batches is not None:
        causal_lm["micro_batches"] = micro_batches
    return {"task": {"kind": '"causal_lm"'}, "task.causal_lm": causal_lm, "task.causal_lm.config": dict(config)}


def token_data(**keys: Value) -> dict[str, dict[str, Value]]:
    """``tiny_spec``'s ``sections`` for prepared tokens (``source = "tokens"``; string values are
    quoted here: ``path``, ``url``, ``manifest``, ``tokenizer``)."""
    data: dict[str, Value] = {"source": '"tokens"'}
    data.update({key: f'"{value}"' if isinstance(value, str) else value for key, value in keys.items()})
    return {"data": data}


def tiny_spec(
    name: str,
    *,
    d_model: int | str = 32,
    n_layers: int = 1,
    n_heads: int = 2,
    context: int = 32,
    task: Mapping[str, Mapping[str, Value]] | None = None,
    lr: float | None = None,
    batch_size: int | None = 4,
    inner_steps: int | None = 3,
    compression: str | None = "int8",
    overlap: bool | str | None = False,
    min_group_size: int | str | None = 2,
    matchmaking_timeout_s: float | None = 6.0,
    allreduce_timeout_s: float | None = 20.0,
    sections: Mapping[str, Mapping[str, Value]] | None = None,
    extra: str = "",
) -> str:
    """The spec's TOML. ``task`` replaces the byte-level model (``d_model`` ... ``context``) with
    its sections (``llama_task``); any other argument None leaves the spec's default;
    ``sections`` adds keys to a section (``{"inner": {"optimizer": '"sgd"'}}``) or adds a
    section; ``extra`` is appended as is."""
    more = {section: dict(keys) for section, keys in (sections or {}).items()}
    model = {"task.model": {"d_model": d_model, "n_layers": n_layers, "n_heads": n_heads, "context": context}}
    averaging = {
        "compression": None if compression is None else f'"{compression}"',
        "overlap": overlap,
        "min_group_size": min_group_size,
        "matchmaking_timeout_s": matchmaking_timeout_s,
        "allreduce_timeout_s": allreduce_timeout_s,
    }
    body: dict[str, list[str]] = {
        "run": [f'name = "{name}"'],
        **{section: _lines(keys) for section, keys in (task or model).items()},
        "inner": _lines({"lr": lr, "batch_size": batch_size}),
        "rounds": _lines({"inner_steps": inner_steps}),
        "averaging": _lines(averaging),
    }
    for section, keys in more.items():
        body.setdefault(section, []).extend(f"{key} = {_value(value)}" for key, value in keys.items())
    lines = [line for section, keys in body.items() for line in (f"[{section}]", *keys)]
    return "\n".join(lines) + "\n" + extra


COORDINATOR_SPEC = tiny_spec("coord", min_group_size=3, extra='[admission]\nmode = "{mode}"\n{allowlist}\n')
"""A coordinator's run: ``str.format`` it with ``mode`` (open, allowlist) and ``allowlist`` (a TOML line)."""


def bare_spec(name: str, **given: Any) -> str:
    """``tiny_spec`` that writes no averaging key it is not given: the codec, overlap, group size
    and timeouts are the spec's own defaults (a test of the trainer or of a task, not of a swarm
    on a loaded machine)."""
    unset: dict[str, Any] = dict.fromkeys(
        ("compression", "overlap", "min_group_size", "matchmaking_timeout_s", "allreduce_timeout_s")
    )
    return tiny_spec(name, **{**unset, **given})


ZERO_DIGEST = "sha256:" + "0" * 64
TOKEN_RUN_SPEC = bare_spec(
    "tokens",
    task=llama_task(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4),
    inner_steps=5,
    sections=token_data(path="d", manifest=ZERO_DIGEST, tokenizer=ZERO_DIGEST, slots=3),
)
"""A coordinator's token run (a Llama on prepared tokens, three data streams): its reports
state what they read."""
