"""Bad tensors from another peer (NaN/Inf, wrong size, bad weight) never reach the result:
the sender is excluded with a logged reason and honest peers still agree bit for bit. A
member that started the round from another state than the group counts for nothing."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import pytest
import torch
from hivemind import DHT
from hivemind.proto import runtime_pb2

from engine.allreduce import CodecCompression, ExactAllReduceRunner
from engine.averager import ExactAverager
from engine.bulk_settings import BulkSettings
from engine.codecs import get_codec
from engine.outcome import GroupOutcome
from protocol.gathered import Gathered
from protocol.identity import Identity
from protocol.receipts import read_receipt

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
NUMEL = 5000


class NaNCompression(CodecCompression):
    def compress(self, tensor, info, allow_inplace=False):  # type: ignore[no-untyped-def]
        poisoned = tensor.detach().reshape(-1).clone()
        poisoned[::7] = float("nan")
        return runtime_pb2.Tensor(buffer=poisoned.numpy().tobytes(), size=list(tensor.shape), dtype=self.dtype_tag)


class ShortCompression(CodecCompression):
    def compress(self, tensor, info, allow_inplace=False):  # type: ignore[no-untyped-def]
        flat = tensor.detach().reshape(-1)[:-1].contiguous()
        return runtime_pb2.Tensor(buffer=self.codec.encode(flat), size=[flat.numel()], dtype=self.dtype_tag)


class GarbageCompression(CodecCompression):
    """Bytes of the right length for its codec, but random: out-of-range codes, bad scales."""

    def compress(self, tensor, info, allow_inplace=False):  # type: ignore[no-untyped-def]
        size = self.codec.encoded_size(tensor.numel())
        noise = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
        return runtime_pb2.Tensor(buffer=noise.numpy().tobytes(), size=list(tensor.shape), dtype=self.dtype_tag)


def weight_liar(weight: float) -> type[ExactAverager]:
    """An averager whose messages claim ``weight`` (hivemind's own step() would refuse it)."""

    class LyingRunner(ExactAllReduceRunner):
        async def _generate_input_for_peer(self, peer_index):  # type: ignore[no-untyped-def]
            async for message in super()._generate_input_for_peer(peer_index):
                message.weight = weight
                yield message

    # hivemind names RPC handlers after the class: the liar must look like an ExactAverager
    return type("ExactAverager", (ExactAverager,), {"runner_class": LyingRunner})


def peer_vector(index: int, numel: int) -> torch.Tensor:
    """Peer ``index``'s vector: ``index + 1`` plus ``k`` in the ``k``-th run of 2**16 values
    (small integers: their averages are exact, and a value out of place shows)."""
    return float(index + 1) + (torch.arange(numel) // 2**16).to(torch.float32)


def run_group(
    bad: type[CodecCompression] | None,
    bad_weight: float = 1.0,
    gathers: list[dict] | None = None,
    *,
    numel: int = NUMEL,
    streams: int = 1,
    next_chunk_timeout: float = 5.0,
    outcomes: dict[int, GroupOutcome] | None = None,
    codec_name: str = "none",
    vector: Callable[[int, int], torch.Tensor] | None = None,
    keys: list[Identity] | None = None,
    bulk: bool = False,
    await_attacker: bool = True,
) -> list[torch.Tensor | None]:
    """Each member's vector after one step (None where its step failed); ``outcomes``, when
    given, receives each completed step's outcome (what it left out of the round, and why).
    ``await_attacker=False``: the honest members' steps only are waited for (the attacker's,
    its parts refused, waits out its deadline for averages nobody sends it; it is shut down)."""
    codec = get_codec(codec_name)
    first = DHT(start=True, host_maddrs=LOOPBACK)
    dhts = [first] + [DHT(start=True, host_maddrs=LOOPBACK, initial_peers=first.get_visible_maddrs()) for _ in range(2)]
    averagers = []
    try:
        for i, dht in enumerate(dhts):
            malicious = i == 2
            averager_class = weight_liar(bad_weight) if malicious and bad_weight != 1.0 else ExactAverager
            averager = averager_class(
                numel,
                dht,
                codec=codec,
                prefix="badtensors",
                start=False,
                min_group_size=3,
                target_group_size=3,
                min_matchmaking_time=5.0,
                request_timeout=3.0,
                allreduce_timeout=15.0,
                next_chunk_timeout=next_chunk_timeout,
                client_mode=malicious,  # the attacker only sends; honest peers reduce
                streams=streams,
                receipt_key=keys[i].to_pem() if keys is not None else None,
                bulk=BulkSettings(enabled=bulk),
            )
            if malicious and bad is not None:
                averager.codec_compression = bad(codec)  # before the averager process starts
            averager.run_in_background(await_ready=True)
            with averager.get_tensors() as tensors:
                tensors[0].copy_((vector or peer_vector)(i, numel))
            averagers.append(averager)
        results: list[torch.Tensor | None] = [None] * 3

        def step(i: int) -> None:
            try:
                gather = gathers[i] if gathers is not None else None
                outcome = averagers[i].step(weight=1.0, timeout=30, allow_retries=False, gather=gather)
            except Exception:  # noqa: BLE001 - a failed step leaves the vector untouched
                outcome = None
            if outcome:
                if outcomes is not None:
                    outcomes[i] = outcome
                with averagers[i].get_tensors() as tensors:
                    results[i] = tensors[0].clone()

        threads = [threading.Thread(target=step, args=(i,), daemon=True) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads if await_attacker else threads[:2]:
            thread.join(timeout=90)
        return results
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_honest_group_averages_exactly() -> None:
    outcomes: dict[int, GroupOutcome] = {}
    results = run_group(None, outcomes=outcomes, bulk=True)
    assert all(r is not None for r in results[:2])
    assert torch.equal(results[0], results[1])
    assert torch.equal(results[0], torch.full((NUMEL,), 2.0))  # (1 + 2 + 3) / 3
    # every part went over the bulk channel (engine.bulk_channel): members 0 and 1 reduce, and
    # each sends to the other reducers (2, in client mode, to both)
    assert sorted(len(outcomes[i].stats.over_bulk) for i in range(3)) == [1, 1, 2], outcomes
    assert set(outcomes[2].stats.over_bulk) == set(outcomes[0].stats.over_bulk) | set(outcomes[1].stats.over_bulk)


def test_each_reducer_signs_a_receipt_for_what_it_took_from_each_sender() -> None:
    """Members 0 and 1 reduce (2 only sends, in client mode): each sender holds, from each
    reducer, a receipt for its own parts in the round the group lands, at the weight it sent."""
    keys = [Identity.generate() for _ in range(3)]
    gathers = [Gathered(id=k.public_key.id, round=4, digest="d", samples=1.0).to_wire() for k in keys]
    outcomes: dict[int, GroupOutcome] = {}
    results = run_group(None, gathers=gathers, keys=keys, outcomes=outcomes)
    assert all(r is not None for r in results), results
    for i in range(3):
        stated = outcomes[i].gathered
        reducers = {stated[peer].id for peer in outcomes[i].stats.receipts}  # type: ignore[union-attr]
        assert reducers == {keys[j].public_key.id for j in (0, 1) if j != i}, i
        for peer, receipt in outcomes[i].stats.receipts.items():
            reducer = stated[peer]
            assert reducer is not None
            read = read_receipt(receipt, reducer=reducer.id, run="badtensors", round_=5, sender=keys[i].public_key.id)
            assert (read.weight, read.offence) == (1.0, "")


STREAMED = 4 * 2**16 + 1000
"""A vector cut into 4 fragments for 4 streams (``engine.fragments``), the last one longer."""


def test_fragments_averaged_at_once_land_in_place_bit_identically() -> None:
    # all three members are honest here: a sender stalled by a loaded machine must not be
    # dropped from a reducer's part (next_chunk_timeout), which would average it over two
    outcomes: dict[int, GroupOutcome] = {}
    results = run_group(None, numel=STREAMED, streams=4, next_chunk_timeout=12.0, outcomes=outcomes)
    assert all(r is not None for r in results), results
    expected = peer_vector(1, STREAMED)  # the mean of peers 0, 1 and 2: peer 1's vector
    for i, result in enumerate(results):
        assert result is not None
        wrong = (result != expected).nonzero().flatten()
        left_out = (outcomes[i].stats.missing, outcomes[i].stats.offences)  # which reducers failed, and why
        assert not len(wrong), (i, len(wrong), wrong[:5].tolist(), result[wrong[:5]].tolist(), left_out)


@pytest.mark.parametrize(
    ("bad", "weight", "streams", "bulk"),
    [
        (NaNCompression, 1.0, 1, False),
        (ShortCompression, 1.0, 1, False),
        (None, math.inf, 1, False),
        (None, -1.0, 1, False),
        (None, math.nan, 1, False),
        (NaNCompression, 1.0, 4, False),
        (NaNCompression, 1.0, 4, True),
        (ShortCompression, 1.0, 1, True),
    ],
    ids=[
        "nan-values",
        "wrong-size",
        "inf-weight",
        "negative-weight",
        "nan-weight",
        "nan-values-4-streams",
        "nan-values-4-streams-bulk-channel",
        "wrong-size-bulk-channel",
    ],
)
def test_bad_contribution_is_excluded(
    bad: type[CodecCompression] | None, weight: float, streams: int, bulk: bool
) -> None:
    """(With ``bulk``: the parts travel over the bulk channel, ``engine.bulk_channel``: the same
    handler refuses them.)"""
    numel = STREAMED if streams > 1 else NUMEL
    outcomes: dict[int, GroupOutcome] = {}
    results = run_group(
        bad, bad_weight=weight, numel=numel, streams=streams, bulk=bulk, outcomes=outcomes, await_attacker=False
    )
    honest = [r for r in results[:2] if r is not None]
    expected = (peer_vector(0, numel) + peer_vector(1, numel)) / 2  # the attacker is left out
    for result in honest:
        assert bool(torch.isfinite(result).all())
        assert torch.equal(result, expected)
    assert len(honest) == 2
    if bad is not None:  # each honest reducer refused the attacker's parts and named it, one sender
        named = [set(outcomes[i].stats.refused_senders) for i in (0, 1)]
        assert named[0] == named[1] and len(named[0]) == 1, named


def test_a_member_that_started_from_another_state_counts_zero_and_gets_the_average() -> None:
    """Peer 2 gathered another pre-round digest than the other two: its parts count with
    weight 0 everywhere, and it receives the same average (so it sees it is out of sync)."""
    results = run_group(
        None,
        gathers=[
            {"round": 3, "digest": "sha256:a"},
            {"round": 3, "digest": "sha256:a"},
            {"round": 3, "digest": "sha256:b"},
        ],
    )
    assert all(r is not None for r in results), results
    for result in results:
        assert torch.equal(result, torch.full((NUMEL,), 1.5))  # (1 + 2) / 2, bit for bit on all three


SPARSE_GATHERS = [{"round": 6, "digest": "sha256:a"}] * 3
"""Every member states round 6: the ``sparse`` codec's mask is that round's."""


def sparse_vector(index: int, numel: int) -> torch.Tensor:
    """Peer ``index``'s vector for the ``sparse`` codec (2-bit values): 1.5 (index + 1)
    everywhere. A block's values, each peer's and the mean of the first two or all three, are
    the top level 1.5 times an exact scale (absmax / 1.5), so rounding to nearest (a sender)
    and stochastic rounding (a reducer, with a dither the test does not know) give the same
    bits."""
    return torch.full((numel,), 1.5 * (index + 1))


def _sparse_expected(members: list[int], numel: int) -> torch.Tensor:
    """What a group of ``members`` averages with ``sparse`` at round 6: the mean of their
    vectors at the round's positions, zero elsewhere."""
    codec = get_codec("sparse").at_round(6)
    return codec.roundtrip(sum(sparse_vector(i, numel) for i in members) / len(members))


def test_sparse_codec_group_averages_the_rounds_positions_bit_identically() -> None:
    results = run_group(
        None, gathers=SPARSE_GATHERS, codec_name="sparse", numel=STREAMED, streams=4, vector=sparse_vector
    )
    assert all(r is not None for r in results), results
    expected = _sparse_expected([0, 1, 2], STREAMED)
    for result in results:
        assert torch.equal(result, expected)
    assert int((expected != 0).sum()) == get_codec("sparse").at_round(6).kept(STREAMED).numel()


@pytest.mark.parametrize("bad", [GarbageCompression, NaNCompression, ShortCompression], ids=["garbage", "nan", "short"])
def test_sparse_codec_refuses_a_malformed_payload_and_averages_the_rest(bad: type[CodecCompression]) -> None:
    results = run_group(bad, gathers=SPARSE_GATHERS, codec_name="sparse", vector=sparse_vector, await_attacker=False)
    honest = [r for r in results[:2] if r is not None]
    assert len(honest) == 2
    for result in honest:
        assert torch.equal(result, _sparse_expected([0, 1], NUMEL))
