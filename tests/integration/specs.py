"""The run specs of the integration tests' local swarms: a tiny byte-level GPT that trains in
seconds on a CPU, with timeouts short enough for a test and long enough for a loaded machine.
Every test's spec comes from ``tiny_spec``; a value given as a string is written as is, so a
spec may hold ``str.format`` fields for the test to fill (``{codec}``)."""

from __future__ import annotations

from collections.abc import Mapping

Value = str | int | float | bool


def _value(value: Value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def tiny_spec(
    name: str,
    *,
    d_model: int | str = 32,
    n_layers: int = 1,
    n_heads: int = 2,
    context: int = 32,
    lr: float | None = None,
    batch_size: int | None = 4,
    inner_steps: int | None = 3,
    compression: str = "int8",
    overlap: bool | str | None = False,
    min_group_size: int | str = 2,
    matchmaking_timeout_s: float = 6.0,
    allreduce_timeout_s: float = 20.0,
    sections: Mapping[str, Mapping[str, Value]] | None = None,
    extra: str = "",
) -> str:
    """The spec's TOML. ``lr``, ``batch_size``, ``inner_steps`` and ``overlap`` None leave the
    spec's defaults; ``sections`` adds keys to a section (``{"inner": {"optimizer": '"sgd"'}}``,
    strings written as is: quote TOML strings) or adds a section; ``extra`` is appended as is."""
    more = {section: dict(keys) for section, keys in (sections or {}).items()}
    body: dict[str, list[str]] = {
        "run": [f'name = "{name}"'],
        "task.model": [
            f"d_model = {d_model}",
            f"n_layers = {n_layers}",
            f"n_heads = {n_heads}",
            f"context = {context}",
        ],
        "inner": [
            *([f"lr = {lr}"] if lr is not None else []),
            *([f"batch_size = {batch_size}"] if batch_size is not None else []),
        ],
        "rounds": [f"inner_steps = {inner_steps}"] if inner_steps is not None else [],
        "averaging": [
            f'compression = "{compression}"',
            *([f"overlap = {_value(overlap)}"] if overlap is not None else []),
            f"min_group_size = {min_group_size}",
            f"matchmaking_timeout_s = {matchmaking_timeout_s}",
            f"allreduce_timeout_s = {allreduce_timeout_s}",
        ],
    }
    for section, keys in more.items():
        body.setdefault(section, []).extend(f"{key} = {_value(value)}" for key, value in keys.items())
    lines = [line for section, keys in body.items() for line in (f"[{section}]", *keys)]
    return "\n".join(lines) + "\n" + extra


COORDINATOR_SPEC = tiny_spec("coord", min_group_size=3, extra='[admission]\nmode = "{mode}"\n{allowlist}\n')
"""A coordinator's run: ``str.format`` it with ``mode`` (open, allowlist) and ``allowlist`` (a TOML line)."""
