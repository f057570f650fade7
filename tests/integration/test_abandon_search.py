"""A search given up from inside ends at once and leaves the averager able to average
(``ExactAverager.abandon_search``), on real in-process averagers over loopback.

The churn lab's home peer that chased the swarm for 29 rounds: the trainer gave up its first
search (the swarm had landed the round it met at) with hivemind's ``StepControl.cancel``, which
cancels the step's matchmaking task without awaiting it; asyncio collected the task half
cancelled ("Task was destroyed but it is pending!", "aclose(): asynchronous generator is
already running") and the search's cleanup never ran, so none of that averager's later
searches found a group. The race is asyncio's garbage collector's, which a test cannot time;
this test pins what the fix promises: the step ends as "could not find a group" within a
second or two of the abandon (not at its 60 s deadline, and without hivemind's retries), and
the same averager then averages the next round with the others."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
from hivemind import DHT
from hivemind.utils import get_dht_time
from hivemind.utils.mpfuture import MPFuture

from engine.averager import ExactAverager
from engine.codecs import get_codec
from engine.outcome import GroupOutcome
from protocol.gathered import Gathered

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
# (a swarm per test: ``tests/integration/conftest.py`` gives each test a fresh result pipe)
NUMEL = 1000


async def _count_followers(self: ExactAverager, future: MPFuture[int]) -> None:
    """(In the averager process) how many followers this peer's search holds as a leader now."""
    future.set_result(len(self._matchmaking.current_followers))


# hivemind names RPC handlers after the class: it must look like an ExactAverager
Probed = type("ExactAverager", (ExactAverager,), {"_count_followers": _count_followers})


def _followers(averager: ExactAverager) -> int:
    future: MPFuture[int] = MPFuture()
    averager._outer_pipe.send(("_count_followers", [], dict(future=future)))
    return future.result(timeout=5)


def _gather(peer: int, round_: int) -> bytes:
    return Gathered(id=f"peer-{peer}", round=round_, digest="blake3:" + "00" * 32, samples=1).to_wire()


@pytest.fixture
def averagers() -> Iterator[list[ExactAverager]]:
    first = DHT(start=True, host_maddrs=LOOPBACK)
    dhts = [first] + [DHT(start=True, host_maddrs=LOOPBACK, initial_peers=first.get_visible_maddrs()) for _ in range(2)]
    made = [
        Probed(
            NUMEL,
            dht,
            codec=get_codec("none"),
            prefix="abandon",
            start=True,
            min_group_size=2,
            min_matchmaking_time=2.0,
            request_timeout=3.0,
            allreduce_timeout=30.0,
        )
        for dht in dhts
    ]
    yield made
    for averager in made:
        averager.shutdown()
    for dht in reversed(dhts):
        dht.shutdown()


def test_an_abandoned_search_ends_at_once_and_the_averager_averages_the_next_round(
    averagers: list[ExactAverager],
) -> None:
    lonely = averagers[2]
    control = lonely.step(
        gather=_gather(2, 0), scheduled_time=get_dht_time() + 30, timeout=60, wait=False, allow_retries=True
    )
    deadline = time.monotonic() + 10
    while not lonely.abandon_search() and time.monotonic() < deadline:  # once its search is under way
        time.sleep(0.1)
    abandoned = time.monotonic()
    with pytest.raises(Exception, match="could not find a group"):
        control.result(timeout=10)
    assert time.monotonic() - abandoned < 5, "the step ran on after its search was given up"
    assert not lonely.abandon_search(), "nothing is searching any more"

    outcomes: list[object] = [None] * 3

    def step(i: int) -> None:
        try:
            outcomes[i] = averagers[i].step(gather=_gather(i, 1), scheduled_time=get_dht_time() + 4, timeout=30)
        except Exception as exc:  # noqa: BLE001 - the assertion below names it
            outcomes[i] = exc

    threads = [threading.Thread(target=step, args=(i,), daemon=True) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert all(isinstance(o, GroupOutcome) and not o.failed and len(o.gathered) == 3 for o in outcomes), outcomes


def test_a_leader_that_gives_up_sends_its_follower_away_cleanly(
    capfd: pytest.CaptureFixture[str], averagers: list[ExactAverager]
) -> None:
    """A leader whose search is given up while a follower waits in its group tells the follower
    its group was disbanded (hivemind's GROUP_DISBANDED), not an internal error: the follower
    looks on, and neither logs an error (``capfd`` first: the averagers fork with its stderr)."""
    leader, follower = averagers[0], averagers[1]
    led = leader.step(gather=_gather(0, 0), scheduled_time=get_dht_time() + 8, timeout=30, wait=False)
    following = follower.step(gather=_gather(1, 0), scheduled_time=get_dht_time() + 12, timeout=14, wait=False)
    deadline = time.monotonic() + 8
    while _followers(leader) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _followers(leader) == 1, "the follower never joined the leader's group"
    assert leader.abandon_search()
    with pytest.raises(Exception, match="could not find a group"):
        led.result(timeout=5)
    with pytest.raises(Exception, match="could not find a group"):  # alone, it finds no other group
        following.result(timeout=30)
    errors = capfd.readouterr().err
    assert "not iterable" not in errors and "INTERNAL_ERROR" not in errors, errors
