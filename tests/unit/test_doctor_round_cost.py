"""The doctor's "averaging on this uplink" check (``swarmtrain.doctor.round_cost``): the upload
time of one round with each codec, from the bytes per value each puts on the wire."""

from __future__ import annotations

import pytest

from protocol.spec import AveragingSection
from swarmtrain.doctor.round_cost import round_cost


def test_a_round_of_llama_1b_on_a_50_mbit_uplink_per_codec() -> None:
    detail, data = round_cost(AveragingSection(compression="sparse"), 1_240_000_000, 50e6)
    seconds = data["upload_s_per_round"]
    assert data["codec"] == "sparse 1/4" and detail.startswith("31.0 s of upload per round with the run's sparse 1/4")
    # twice the vector at 4 bytes per value for fp32; 20 bytes per 256 values for sparse 1/4
    assert seconds["none"] == pytest.approx(2 * 1.24e9 * 4 * 8 / 50e6)
    assert seconds["sparse 1/4"] == pytest.approx(seconds["none"] * 20 / 256 / 4)
    assert seconds["4bit"] == pytest.approx(seconds["none"] * (0.5 + 4 / 64) / 4)
    assert seconds["sparse 1/8"] == pytest.approx(seconds["sparse 1/4"] / 2)


def test_the_runs_own_codec_comes_first_whatever_it_is() -> None:
    detail, data = round_cost(AveragingSection(compression="sparse", density=1 / 8, bits=4), 1_000_000, 1e6)
    assert detail.startswith("1.1 s of upload per round with the run's sparse 1/8 4-bit")
    assert "sparse 1/8 4-bit" in data["upload_s_per_round"] and "sparse 1/4" in data["upload_s_per_round"]


@pytest.mark.parametrize(("params", "upload"), [(0, 1e6), (10, 0.0), (10, -5.0)])
def test_no_model_or_no_uplink_is_an_error_not_a_division(params: int, upload: float) -> None:
    with pytest.raises(ValueError, match="need a model and an uplink"):
        round_cost(AveragingSection(), params, upload)


def test_the_join_estimate_is_the_state_then_an_update_per_round_landed_meanwhile() -> None:
    from swarmtrain.doctor.round_cost import join_cost

    detail, data = join_cost(AveragingSection(compression="fp16"), 1_000_000_000, 100e6)
    assert data["state_download_s"] == pytest.approx(640.0)  # 8 GB at 100 Mbit/s
    assert data["update_s_per_round"] == pytest.approx(160.0)  # 2 GB of fp16
    assert "8,000.0 MB" in detail and "640.0 s" in detail
    with pytest.raises(ValueError, match="downlink"):
        join_cost(AveragingSection(), 1000, 0.0)
