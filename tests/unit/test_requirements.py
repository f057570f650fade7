"""``swarmtrain doctor --requirements``: one peer's needs, from the spec alone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from engine.checkpoint import Checkpointer
from engine.update_store import KEPT_BYTES
from protocol.spec import load_spec
from swarmtrain.doctor import requirements as req

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_its_constants_are_the_peers() -> None:
    assert req.KEPT_BYTES == KEPT_BYTES
    assert Checkpointer.__init__.__kwdefaults__["keep"] == req.CHECKPOINTS_KEPT


def test_llama_1b_at_its_time_budget() -> None:
    needs = req.requirements(load_spec(EXAMPLES / "llama-1b.toml"))
    params = 1_235_814_400
    assert needs.params == params
    # 4-bit with a float32 scale per 64 values, each way twice the vector at the large-group bound
    assert needs.up_per_round == pytest.approx(2 * params * (0.5 + 4 / 64))
    assert needs.round_s == 3600.0
    assert needs.per_day(needs.up_per_round) == pytest.approx(needs.up_per_round * 24)
    # 500 steps of 8 sequences of 2049 uint32 tokens (a vocabulary of 128,256 ids)
    assert needs.data_per_round == 500 * 8 * 2049 * 4
    assert needs.join_bytes == 8 * params
    day_of_data = needs.data_per_round * 24
    checkpoints = 2 * params * (3 * 4 + 2 * 4 + 2)  # θ_g, momentum, model, AdamW moments, residual
    served = 2 * params * 4  # θ_g and the momentum, the file a newcomer downloads
    assert needs.disk_bytes == int(checkpoints + min(16 * needs.up_per_round / 2, KEPT_BYTES) + served + day_of_data)
    assert needs.gpu_bytes > 20 << 30 and needs.shm_bytes == params * 4


def test_a_faster_pace_scales_the_day_and_a_spec_without_budget_asks_for_one() -> None:
    spec = load_spec(EXAMPLES / "llama-1b.toml")
    hourly, fast = req.requirements(spec), req.requirements(spec, round_s=300)
    assert fast.per_day(fast.up_per_round) == pytest.approx(12 * hourly.per_day(hourly.up_per_round))
    tiny = req.requirements(load_spec(EXAMPLES / "llama-tiny.toml"))
    assert tiny.round_s is None and tiny.per_day(tiny.up_per_round) is None
    assert any("give --round-s" in line for line in tiny.lines())
    with pytest.raises(ValueError, match="positive"):
        req.requirements(spec, round_s=0)


def test_the_lines_name_every_resource() -> None:
    lines = req.requirements(load_spec(EXAMPLES / "demo.toml")).lines()
    for name in ("model", "GPU memory", "host RAM", "/dev/shm", "disk", "upload", "download"):
        assert any(line.startswith(name) for line in lines), name
    assert "GB per day at one round every 10 s" in "\n".join(lines)


def test_the_readmes_table_is_what_the_doctor_computes() -> None:
    """The README's requirements at the example specs are the doctor's, not copied by hand."""
    from peer.node.footprint import gib

    readme = (EXAMPLES.parent / "README.md").read_text()
    rows = {
        m.group(1): m.group(2) for m in re.finditer(r"^\| `examples/([\w-]+)\.toml` \(.*?\) \| (.*) \|$", readme, re.M)
    }
    assert set(rows) == {"llama-1b", "gpu-100m", "demo"}, rows
    for name, row in rows.items():
        needs = req.requirements(load_spec(EXAMPLES / f"{name}.toml"))
        up, down = needs.per_day(needs.up_per_round), needs.per_day(needs.down_per_round + needs.data_per_round)
        assert up is not None and down is not None
        disk = needs.disk_bytes / req.GB
        expected = [
            gib(needs.gpu_bytes),
            gib(needs.host_bytes),
            gib(needs.shm_bytes),
            f"{disk:.1f} GB" if disk >= 1 else f"{needs.disk_bytes / 1e6:.1f} MB",
            f"{up / req.GB:.1f} / {down / req.GB:.1f} GB",
        ]
        assert [cell.strip() for cell in row.split("|")] == expected, name
