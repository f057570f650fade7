"""Two machines behind one address probe at once (a home's NAT; the README walk-through's two
volunteers on one host): the coordinator dials back one source at a time and refuses the other
as busy. The refused one asks again instead of reporting itself unreachable (the doctor printed
"FAIL reachable from outside: ... one at a time per source"); any other refusal is final."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from peer.net import dial_back
from peer.net.dial_back import Greeter, ask_dial_back
from protocol import coordinator_pb2 as pb
from protocol.errors import DIAL_BACK_BUSY


class Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class Stub:
    """A coordinator that refuses the first ``refusals`` probes with ``refusal``."""

    def __init__(self, refusals: int, refusal: Refused) -> None:
        self.refusals, self.refusal, self.calls = refusals, refusal, 0

    def Probe(self, request: pb.ProbeRequest, timeout: float) -> pb.ProbeResponse:
        self.calls += 1
        if self.calls <= self.refusals:
            raise self.refusal
        return pb.ProbeResponse(observed_host="203.0.113.7", dialed=True, dial_matched=True)


@pytest.fixture
def greeter() -> Any:
    g = Greeter(0)
    yield g
    g.close()


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dial_back, "BUSY_PAUSE_S", 0.01)


BUSY = Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{DIAL_BACK_BUSY}: a dial-back to 203.0.113.7 is running")


def test_a_probe_refused_as_busy_is_asked_again_and_answered(greeter: Greeter) -> None:
    stub = Stub(2, BUSY)
    seen = ask_dial_back(stub, greeter, timeout_s=5)
    assert seen.reached and stub.calls == 3


def test_a_coordinator_busy_for_longer_than_the_wait_is_a_refusal(
    greeter: Greeter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(dial_back, "BUSY_WAIT_S", 0.1)
    stub = Stub(10**6, BUSY)
    with pytest.raises(grpc.RpcError):
        ask_dial_back(stub, greeter, timeout_s=5)
    assert 2 <= stub.calls < 100


@pytest.mark.parametrize(
    "refusal",
    [
        Refused(grpc.StatusCode.RESOURCE_EXHAUSTED, "more than 60 probes a minute from 203.0.113.7: wait a minute"),
        Refused(grpc.StatusCode.INVALID_ARGUMENT, f"{DIAL_BACK_BUSY} said by the wrong status"),
        Refused(grpc.StatusCode.UNAVAILABLE, "connection refused"),
    ],
)
def test_any_other_refusal_is_final_at_once(greeter: Greeter, refusal: Refused) -> None:
    stub = Stub(1, refusal)
    with pytest.raises(grpc.RpcError):
        ask_dial_back(stub, greeter, timeout_s=5)
    assert stub.calls == 1
