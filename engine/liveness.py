"""Whether a member of the last round is still there: the question a round's leader asks of the
roster members that have not joined its group.

A round's leader closes its group as soon as the whole roster of the group's state is in, or
has said it left (``protocol.roster.leader_may_close``). A member that died without a word (a
SIGKILL, a lost spot instance, a pulled cable) said nothing, and the leader waited out its
window for it: in the churn lab (``benchmarks/churn.py``) every kill made the next round 9 s
longer than its 8 s phase. Now the leader, once it has waited ``PROBE_AFTER_S`` for a member,
asks it over libp2p (``rpc_alive``, one small unary call); a member that does not answer
within ``PROBE_TIMEOUT_S`` counts as gone for this round, like one that left cleanly.

A probe only ends a wait early. The round's verdict still needs more than half of the whole
roster in the group (``protocol.roster.verdict``), so a member that was alive but slow to
answer loses this round only (its work carries over, as for any round it misses), and nobody
can lower a round's majority by making a member look dead. A member that answers is waited for
as before. Any answer counts, a refusal included (a peer that runs a version without this call
still answers "no such protocol"): only silence, a refused dial or a timeout marks a member gone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from hivemind.p2p import P2PContext, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError
from hivemind.proto import averaging_pb2

__all__ = ["PROBE_AFTER_S", "PROBE_TIMEOUT_S", "PROBES_AT_ONCE", "LivenessMixin", "answering", "silent"]

logger = logging.getLogger(__name__)

PROBE_AFTER_S = 2.0
"""How long a leader waits for a roster member before it asks whether it is there: members of
one state launch within a second or two of each other (their phases are alike), so a live
member is usually in by then and the leader asks nobody."""
PROBE_TIMEOUT_S = 2.0
"""How long a probed member has to answer: one round trip over its path (a relay's included)."""
PROBES_AT_ONCE = 16
"""The most members one leader probes per poll, so a leader of a large round whose members are
still arriving sends a bounded number of calls."""

_ANSWERED = ("protocol not supported", "protocols not supported")
"""What the remote's libp2p daemon says for a call it has no handler for: an answer."""


class LivenessMixin:
    """The averager's side of a probe: answer at once, to anyone (it says no more than that the
    peer can be dialled, which anyone can find out by dialling it)."""

    async def rpc_alive(self, request: averaging_pb2.AveragingData, context: P2PContext) -> averaging_pb2.AveragingData:
        return averaging_pb2.AveragingData(code=averaging_pb2.NO_CODE)


Call = Callable[[PeerID], Awaitable[Any]]
"""Sends one probe to a peer (``rpc_alive`` through the averager's stub) and waits for its answer."""


async def answering(call: Call, peer: PeerID, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether ``peer`` answers a probe sent by ``call`` within ``timeout_s``."""
    try:
        await asyncio.wait_for(call(peer), timeout=timeout_s)
        return True
    except P2PHandlerError:  # its handler failed: it is there
        return True
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - a dial refused, a stream reset, a timeout: silence
        if any(text in str(exc) for text in _ANSWERED):
            return True
        logger.debug("%s does not answer: %r", peer, exc)
        return False


async def silent(call: Call, peers: Iterable[PeerID], timeout_s: float = PROBE_TIMEOUT_S) -> frozenset[PeerID]:
    """The peers of ``peers`` (at most ``PROBES_AT_ONCE`` of them, all at once) that do not answer."""
    asked = list(peers)[:PROBES_AT_ONCE]
    answers = await asyncio.gather(*(answering(call, peer, timeout_s) for peer in asked))
    return frozenset(peer for peer, answered in zip(asked, answers) if not answered)
