"""A member's bandwidth is what it says about itself: the run gives every member that reduces
an equal share of the vector whatever it claims (``engine.matchmaking.equal_shares``, applied by
``ExactAverager._aggregate_with_group`` before hivemind's load balancing)."""

from __future__ import annotations

import math

import pytest
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.utils import MSGPackSerializer

from engine.matchmaking import equal_shares

SIZE = 1_000_000


def _gather(bandwidth: float | None, mode: AveragingMode = AveragingMode.NODE) -> bytes:
    return MSGPackSerializer.dumps([bandwidth, mode.value, MSGPackSerializer.dumps({"round": 3})])


def _fractions(gathered: tuple[bytes, ...]) -> tuple[int, ...]:
    """hivemind's shares, computed as its ``_aggregate_with_group`` does."""
    rows = [MSGPackSerializer.loads(data) for data in gathered]
    bandwidths = [bw if AveragingMode(mode) != AveragingMode.CLIENT else 0.0 for bw, mode, _user in rows]
    return tuple(load_balance_peers(SIZE, bandwidths, 0))


HONEST = (_gather(None), _gather(None), _gather(None), _gather(None, AveragingMode.CLIENT))


@pytest.mark.parametrize("lie", [math.nan, math.inf, 1e30, -5.0, 0.0], ids=["nan", "inf", "huge", "negative", "zero"])
def test_a_members_bandwidth_claim_changes_nobodys_share(lie: float) -> None:
    lying = (_gather(lie), *HONEST[1:])
    assert _fractions(equal_shares(lying)) == _fractions(equal_shares(HONEST)) == _fractions(HONEST)
    assert _fractions(HONEST) == (SIZE // 3 + 1, SIZE // 3, SIZE // 3, 0)  # equal shares; a client reduces nothing


@pytest.mark.filterwarnings("ignore:.*interior-point:DeprecationWarning")  # hivemind's solver, with a real bandwidth
def test_hivemind_alone_takes_the_claim() -> None:
    """Without ``equal_shares``: infinity hands the liar most of the vector, NaN fails the round."""
    inf = _fractions((_gather(math.inf), _gather(1e8), _gather(1e8), _gather(None, AveragingMode.CLIENT)))
    assert inf[0] > SIZE // 2
    with pytest.raises(AssertionError):  # inside hivemind's solver: the round fails in every member
        _fractions((_gather(math.nan), _gather(1e8), _gather(1e8), _gather(None, AveragingMode.CLIENT)))


def test_the_members_own_statements_are_kept_and_malformed_bytes_left_to_hivemind() -> None:
    shared = equal_shares((_gather(math.inf), b"\xc1not msgpack"))
    assert MSGPackSerializer.loads(shared[0]) == [None, AveragingMode.NODE.value, MSGPackSerializer.dumps({"round": 3})]
    assert shared[1] == b"\xc1not msgpack"


@pytest.mark.parametrize(
    "claim", [AveragingMode.AUX.value, 7, -1, "aux", None, [2]], ids=["aux", "7", "-1", "str", "none", "list"]
)
def test_a_members_mode_claim_is_a_client_or_a_full_member(claim: object) -> None:
    """hivemind reads the mode each member gathered: 7 failed the round in every member
    (``AveragingMode(7)``), and an auxiliary reduces without sending. No swarmtrain peer is an
    auxiliary: anything but a client counts as a full member (one that sends nothing is then
    left out of the parts it did not send, and caught by the audit of its own part)."""
    lying = (MSGPackSerializer.dumps([None, claim, MSGPackSerializer.dumps({"round": 3})]), *HONEST[1:])
    if claim == AveragingMode.AUX.value:  # what hivemind alone would do with it: an auxiliary, or fail
        assert AveragingMode(MSGPackSerializer.loads(lying[0])[1]) == AveragingMode.AUX
    else:
        with pytest.raises((ValueError, TypeError)):
            AveragingMode(MSGPackSerializer.loads(lying[0])[1])
    shared = equal_shares(lying)
    assert [AveragingMode(MSGPackSerializer.loads(data)[1]) for data in shared] == [
        AveragingMode.NODE,
        AveragingMode.NODE,
        AveragingMode.NODE,
        AveragingMode.CLIENT,
    ]
    assert _fractions(shared) == _fractions(HONEST)
