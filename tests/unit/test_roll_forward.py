"""A newcomer that rolls a downloaded state forward by a round's kept update
(``peer.round.host_passes.roll_forward``) makes the very bytes every member's landing made: the
state digest would otherwise refuse it."""

from __future__ import annotations

import pytest
import torch

from engine.codecs import get_codec
from peer.round.host_passes import Staging, land_round, roll_forward
from peer.round.state import GlobalState, flatten
from protocol.errors import MalformedTensorError
from protocol.spec import OuterSection
from protocol.updates import FetchedUpdate

CONFIG = OuterSection(lr=0.7, momentum=0.9, nesterov=True)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 3), torch.nn.Linear(2600, 170), torch.nn.Linear(5, 1))


def _parts(codec_name: str, numel: int, round_: int) -> tuple[torch.Tensor, list[tuple[int, int, bytes]]]:
    """A round's average as its reducers sent it: parts of whole blocks, each encoded once
    (unbiased, as a reducer does), and the vector every member decoded from them."""
    codec = get_codec(codec_name).at_round(round_)
    raw = torch.randn(numel, generator=torch.Generator().manual_seed(3)) * 1e-3
    averaged = torch.empty(numel)
    parts: list[tuple[int, int, bytes]] = []
    width = 64 * 97  # whole blocks of every codec here
    for start in range(0, numel, width):
        piece = raw[start : start + width]
        dither = torch.rand(piece.numel() + 1024, generator=torch.Generator().manual_seed(start))
        buffer = codec.encode_unbiased(piece, dither)
        averaged[start : start + piece.numel()] = codec.decode(buffer, piece.numel())
        parts.append((start, piece.numel(), buffer))
    return averaged, parts


def _landed(
    model: torch.nn.Module, start: GlobalState, averaged: torch.Tensor, missing: list[tuple[int, int]], codec: str
) -> GlobalState:
    """The state a member's landing made from ``start`` by the round's average."""
    member = start.clone()
    land_round(
        model,
        member,
        averaged,
        CONFIG,
        feedback=None,
        launch_point=None,
        keep_progress=False,
        staging=Staging(model),
        missing=missing,
        codec=get_codec(codec).at_round(start.round),
    )
    return member


@pytest.mark.parametrize(
    ("codec_name", "left_out"),
    [("int8", False), ("4bit", True), ("fp16", False), ("sparse", False), ("sparse", True), ("none", True)],
)
def test_rolling_forward_by_the_kept_parts_makes_the_landed_state_bit_for_bit(codec_name: str, left_out: bool) -> None:
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    round_ = 5
    start = GlobalState(flatten(model), torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-3, round_)
    averaged, parts = _parts(codec_name, numel, round_)
    missing = [(64 * 10, 64 * 30), (numel - 64 * 3, numel)] if left_out else []

    member = _landed(model, start, averaged, missing, codec_name)
    newcomer = start.clone()
    update = FetchedUpdate(round_, start.digest(), member.digest(), tuple(missing), parts, 0.0, "member")
    roll_forward(newcomer, update, CONFIG, get_codec(codec_name))

    assert newcomer.round == member.round == round_ + 1
    assert torch.equal(newcomer.params.view(torch.int32), member.params.view(torch.int32))
    assert torch.equal(newcomer.momentum.view(torch.int32), member.momentum.view(torch.int32))
    assert newcomer.digest() == member.digest()


def test_an_update_of_another_round_or_with_bytes_that_do_not_decode_is_refused() -> None:
    numel = 64 * 200
    state = GlobalState(torch.zeros(numel), torch.zeros(numel), 3)
    _, parts = _parts("int8", numel, 3)
    with pytest.raises(ValueError, match="round 4"):
        roll_forward(state, FetchedUpdate(4, "", "", (), parts, 0.0, "x"), CONFIG, get_codec("int8"))
    start, values, buffer = parts[0]
    short = [(start, values, buffer[:-1]), *parts[1:]]
    with pytest.raises(MalformedTensorError):
        roll_forward(state, FetchedUpdate(3, "", "", (), short, 0.0, "x"), CONFIG, get_codec("int8"))
    nan = torch.full((64,), float("nan"))
    poisoned = [(0, 64, get_codec("none").encode(torch.zeros(64)).replace(b"\0\0\0\0", bytes(nan[:1].numpy()), 1))]
    with pytest.raises(MalformedTensorError):
        roll_forward(state, FetchedUpdate(3, "", "", (), poisoned, 0.0, "x"), CONFIG, get_codec("none"))


def test_a_round_whose_reducer_failed_rolls_forward_by_the_parts_that_arrived() -> None:
    """A reducer that failed mid-round sent none of its parts: members landed the round with its
    range left out and kept the rest; the update is the parts that arrived, and it makes the
    landed state without the missing ones."""
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    round_ = 5
    start = GlobalState(flatten(model), torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-3, round_)
    averaged, parts = _parts("int8", numel, round_)
    failed = parts[1]
    missing = [(failed[0], failed[0] + failed[1])]
    member = _landed(model, start, averaged, missing, "int8")
    newcomer = start.clone()
    arrived = [part for part in parts if part is not failed]
    roll_forward(
        newcomer, FetchedUpdate(round_, "", "", tuple(missing), arrived, 0.0, "member"), CONFIG, get_codec("int8")
    )
    assert newcomer.digest() == member.digest()
