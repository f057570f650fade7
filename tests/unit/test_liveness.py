"""``engine.liveness``: what counts as a member's answer to a leader's probe."""

from __future__ import annotations

import asyncio

from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

from engine.liveness import PROBES_AT_ONCE, answering, silent


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_an_answer_or_a_refusal_is_an_answer() -> None:
    async def answers(peer: object) -> str:
        return "ok"

    async def handler_failed(peer: object) -> None:
        raise P2PHandlerError("boom")

    async def no_such_call(peer: object) -> None:  # a peer of a version without the probe
        raise P2PDaemonError("failed to negotiate protocol: protocols not supported: [ExactAverager.rpc_alive]")

    for call in (answers, handler_failed, no_such_call):
        assert _run(answering(call, "peer", timeout_s=1.0)), call.__name__


def test_a_refused_dial_or_silence_is_no_answer() -> None:
    async def refused(peer: object) -> None:
        raise P2PDaemonError("failed to dial: all dials failed")

    async def reset(peer: object) -> None:
        raise ConnectionResetError("stream reset")

    async def silence(peer: object) -> None:
        await asyncio.sleep(10)

    for call in (refused, reset, silence):
        assert not _run(answering(call, "peer", timeout_s=0.05)), call.__name__


def test_silent_names_those_that_do_not_answer_and_asks_a_bounded_number() -> None:
    asked: list[str] = []

    async def call(peer: str) -> None:
        asked.append(peer)
        if peer.startswith("dead"):
            raise P2PDaemonError("failed to dial")

    peers = ["alive-a", "dead-b", "alive-c", "dead-d"]
    assert _run(silent(call, peers, timeout_s=0.5)) == {"dead-b", "dead-d"}
    asked.clear()
    many = [f"dead-{i}" for i in range(3 * PROBES_AT_ONCE)]
    assert len(_run(silent(call, many, timeout_s=0.5))) == PROBES_AT_ONCE
    assert len(asked) == PROBES_AT_ONCE
