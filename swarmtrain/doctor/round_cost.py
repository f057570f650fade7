"""What one averaging round costs on this machine's measured uplink, for the run's model, with
each codec the spec can name: the volunteer sees what the run's codec asks of the link and
what the others would."""

from __future__ import annotations

from typing import Any

from protocol.spec import DEFAULT_DENSITY, AveragingSection

CODECS: tuple[tuple[str, float | None], ...] = (
    ("none", None),
    ("fp16", None),
    ("int8", None),
    ("4bit", None),
    ("sparse", 1 / 4),
    ("sparse", 1 / 8),
)
"""The codecs compared: every dense one, and ``sparse`` (2-bit values) at 1/4 and 1/8."""


def label(compression: str, density: float | None, bits: int | None = None) -> str:
    if compression != "sparse":
        return compression
    name = f"sparse 1/{round(1 / (density or DEFAULT_DENSITY))}"
    return f"{name} 4-bit" if bits == 4 else name


def round_cost(averaging: AveragingSection, params: int, upload_bits_per_s: float) -> tuple[str, dict[str, Any]]:
    """The upload time of one round per codec (a butterfly all-reduce sends 2(n-1)/n of the
    vector from each member, its parts and then its averaged part: counted at the large-n
    bound, twice the vector), the run's own first."""
    if params <= 0 or upload_bits_per_s <= 0:
        raise ValueError(f"need a model and an uplink, got {params} values and {upload_bits_per_s} bit/s")
    seconds: dict[str, float] = {}
    for compression, density in CODECS:
        section = AveragingSection.model_validate({"compression": compression, "density": density})
        per_value = section.wire_bytes_per_value()
        seconds[label(compression, density)] = 8 * 2 * params * per_value / upload_bits_per_s
    own = label(averaging.compression, averaging.density, averaging.bits)
    seconds.setdefault(own, 8 * 2 * params * averaging.wire_bytes_per_value() / upload_bits_per_s)
    others = ", ".join(f"{name} {s:,.1f} s" for name, s in seconds.items() if name != own)
    detail = (
        f"{seconds[own]:,.1f} s of upload per round with the run's {own} "
        f"({params:,} values at {upload_bits_per_s / 1e6:,.0f} Mbit/s; {others})"
    )
    return detail, {"upload_s_per_round": seconds, "codec": own}


def join_cost(averaging: AveragingSection, params: int, download_bits_per_s: float) -> tuple[str, dict[str, Any]]:
    """How long joining a running swarm takes on the measured downlink: the state (θ_g and the
    outer momentum, 8 bytes a value), then each round the swarm landed meanwhile by its averaged
    update in the run's codec (``peer.round.host_passes.roll_forward``). With rounds of R seconds a
    join takes about ``state_s / (1 - update_s / R)``; never if an update takes a round."""
    if params <= 0 or download_bits_per_s <= 0:
        raise ValueError(f"need a model and a downlink, got {params} values and {download_bits_per_s} bit/s")
    state_s = 8 * 8 * params / download_bits_per_s
    update_s = 8 * params * averaging.wire_bytes_per_value() / download_bits_per_s
    own = label(averaging.compression, averaging.density, averaging.bits)
    detail = (
        f"the state ({8 * params / 1e6:,.1f} MB) downloads in {state_s:,.1f} s at {download_bits_per_s / 1e6:,.0f} "
        f"Mbit/s, then {update_s:,.2f} s per round the swarm landed meanwhile (its {own} update): with rounds of "
        f"R s a join takes about {state_s:,.1f} / (1 - {update_s:,.2f} / R) s"
    )
    return detail, {"state_download_s": state_s, "update_s_per_round": update_s, "codec": own}
