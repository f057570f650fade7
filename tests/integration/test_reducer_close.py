"""A member ends its request stream to a reducer only once it holds every averaged part of
that reducer, and a slow reader still gets all of them, bit-exact.

The reducer's handler (hence the stream, and the reducer's own step: ``wait_until_served``)
ends when the member's request stream ends, so this order makes the stream close after
delivery, never while averaged parts are still on their way. The member here takes each
averaged part 150 ms late, long after the reducer has sent everything into the daemons'
buffers; it counts a request stream it ended too early, and the round must still give the
exact average (the handshake may not deadlock with hivemind's flow control).

A client-mode member must end its request stream before it gets anything (hivemind delays its
results until then), so there the reducer's handler waits for the member to close the stream
(``engine.stream_close.until_reader_closes``): the member here holds its last averaged part
half a second before closing, and the reducer's handler must not end before that."""

from __future__ import annotations

import asyncio
import multiprocessing
import threading
import time
from collections.abc import AsyncIterator

import torch
from hivemind import DHT
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2, runtime_pb2

from engine.allreduce import ExactAllReduceRunner
from engine.averager import ExactAverager
from engine.codecs import get_codec
from engine.outcome import GroupOutcome

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
NUMEL = 2_000_000  # 8 MB in fp32: 8 parts of 512 KiB per member, far beyond the sockets' buffers
READ_DELAY_S = 0.15


EARLY_ENDS = multiprocessing.Value("i", 0)
"""Request streams the slow member ended before it held that reducer's averaged parts (shared
with the averager processes, which fork from this one)."""


class SlowReader(ExactAllReduceRunner):
    """Takes each averaged part from a reducer ``READ_DELAY_S`` late, and counts a request
    stream it ended before holding every averaged part of that reducer."""

    async def _take_averaged_part(self, peer_index: int, part_index: int, serialized: runtime_pb2.Tensor) -> None:
        await asyncio.sleep(READ_DELAY_S)
        await super()._take_averaged_part(peer_index, part_index, serialized)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            yield message
        outputs = self.tensor_part_container
        if outputs._outputs_registered_by_peer[peer_index] < outputs.num_parts_by_peer[peer_index]:
            with EARLY_ENDS.get_lock():
                EARLY_ENDS.value += 1


# hivemind names RPC handlers after the class: it must look like an ExactAverager
SlowAverager = type("ExactAverager", (ExactAverager,), {"runner_class": SlowReader})


HOLD_S = 0.5
CLIENT_HELD = multiprocessing.Value("d", 0.0)
"""When the client-mode member held its last averaged part and was about to close its stream."""
HANDLER_ENDED = multiprocessing.Value("d", 0.0)
"""When the reducer's handler of the client-mode member's stream ended."""


class HoldingClient(ExactAllReduceRunner):
    """A client-mode member that, holding its last averaged part, waits ``HOLD_S`` before its
    stream closes (and notes when it stopped waiting)."""

    async def _take_averaged_part(self, peer_index: int, part_index: int, serialized: runtime_pb2.Tensor) -> None:
        await super()._take_averaged_part(peer_index, part_index, serialized)
        if part_index == self.tensor_part_container.num_parts_by_peer[peer_index] - 1:
            await asyncio.sleep(HOLD_S)
            CLIENT_HELD.value = time.time()


class TimedReducer(ExactAllReduceRunner):
    """A reducer that notes when its handler of a client-mode member's stream ended."""

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        try:
            async for message in super().rpc_aggregate_part(stream, context):
                yield message
        finally:
            if self.should_delay_results(context.remote_id):
                HANDLER_ENDED.value = time.time()


HoldingAverager = type("ExactAverager", (ExactAverager,), {"runner_class": HoldingClient})
TimedAverager = type("ExactAverager", (ExactAverager,), {"runner_class": TimedReducer})


def _average_two(kinds: tuple[type[ExactAverager], type[ExactAverager]], *, client_mode: bool = False) -> None:
    """One round of two members of ``kinds`` (the second in client mode with ``client_mode``):
    both complete it with the exact average."""
    codec = get_codec("none")
    first = DHT(start=True, host_maddrs=LOOPBACK)
    second = DHT(start=True, host_maddrs=LOOPBACK, initial_peers=first.get_visible_maddrs())
    averagers: list[ExactAverager] = []
    try:
        for i, (dht, kind) in enumerate(zip((first, second), kinds)):
            averager = kind(
                NUMEL,
                dht,
                codec=codec,
                prefix="reducerclose",
                start=True,
                min_group_size=2,
                target_group_size=2,
                min_matchmaking_time=2.0,
                request_timeout=3.0,
                allreduce_timeout=60.0,
                client_mode=client_mode and i == 1,
            )
            with averager.get_tensors() as tensors:
                tensors[0].copy_(torch.arange(NUMEL, dtype=torch.float32) * (i + 1))
            averagers.append(averager)
        outcomes: list[object] = [None, None]

        def step(i: int) -> None:
            try:
                outcomes[i] = averagers[i].step(gather={}, timeout=60)
            except Exception as exc:  # noqa: BLE001 - the assertion below names it
                outcomes[i] = exc

        threads = [threading.Thread(target=step, args=(i,), daemon=True) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
        assert all(isinstance(o, GroupOutcome) and not o.failed for o in outcomes), outcomes
        expected = torch.arange(NUMEL, dtype=torch.float32) * 1.5
        for averager in averagers:
            with averager.get_tensors() as tensors:
                assert torch.equal(tensors[0], expected)
    finally:
        for averager in averagers:
            averager.shutdown()
        second.shutdown()
        first.shutdown()


def test_a_slow_reader_gets_every_averaged_part() -> None:
    EARLY_ENDS.value = 0
    _average_two((ExactAverager, SlowAverager))
    assert EARLY_ENDS.value == 0, "the slow member ended a request stream before it held its averaged parts"


def test_a_client_mode_members_stream_ends_only_once_it_closed_it() -> None:
    CLIENT_HELD.value = HANDLER_ENDED.value = 0.0
    _average_two((TimedAverager, HoldingAverager), client_mode=True)
    assert CLIENT_HELD.value > 0 and HANDLER_ENDED.value > 0, (CLIENT_HELD.value, HANDLER_ENDED.value)
    assert HANDLER_ENDED.value >= CLIENT_HELD.value, (
        f"the reducer ended its handler {CLIENT_HELD.value - HANDLER_ENDED.value:.3f} s before the client-mode "
        "member closed its stream"
    )
