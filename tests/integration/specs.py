"""The run specs of the integration tests' local swarms: a tiny byte-level GPT that trains in
seconds on a CPU, with timeouts short enough for a test and long enough for a loaded machine."""

from __future__ import annotations


def tiny_spec(
    name: str,
    *,
    d_model: int = 32,
    context: int = 32,
    lr: float | None = None,
    inner_steps: int = 3,
    compression: str = "int8",
    overlap: bool | None = False,
    min_group_size: int | str = 2,
    matchmaking_timeout_s: float = 6.0,
    allreduce_timeout_s: float = 20.0,
    extra: str = "",
) -> str:
    """The spec's TOML. ``overlap`` None leaves the spec's default; ``min_group_size`` may be a
    ``str.format`` field for the test to fill; ``extra`` is appended as is (more sections)."""
    lines = [
        "[run]",
        f'name = "{name}"',
        "[task.model]",
        f"d_model = {d_model}",
        "n_layers = 1",
        "n_heads = 2",
        f"context = {context}",
        "[inner]",
        *([f"lr = {lr}"] if lr is not None else []),
        "batch_size = 4",
        "[rounds]",
        f"inner_steps = {inner_steps}",
        "[averaging]",
        f'compression = "{compression}"',
        *([f"overlap = {'true' if overlap else 'false'}"] if overlap is not None else []),
        f"min_group_size = {min_group_size}",
        f"matchmaking_timeout_s = {matchmaking_timeout_s}",
        f"allreduce_timeout_s = {allreduce_timeout_s}",
    ]
    return "\n".join(lines) + "\n" + extra


COORDINATOR_SPEC = tiny_spec("coord", min_group_size=3, extra='[admission]\nmode = "{mode}"\n{allowlist}\n')
"""A coordinator's run: ``str.format`` it with ``mode`` (open, allowlist) and ``allowlist`` (a TOML line)."""
