"""A round averaged fragment by fragment (``averaging.sync_fragments``, ``engine.fragment_rounds``):
three real averagers on a real hivemind DHT form one group, then average each fragment when
their hosts open its gate, whenever each host does, through a buffer one fragment long.

- every fragment is the exact mean of the members' values for it, bit-identical in every member,
  with members opening their gates a second apart;
- a member whose host never writes the last fragment (it stopped mid-round) costs the others that
  fragment's share it reduces, the same range in both, and nothing else: the earlier fragments
  averaged with it, the last one without its parts; its own round fails once its deadline passes.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import torch
from hivemind import DHT

from engine.averager import ExactAverager
from engine.codecs import get_codec
from engine.outcome import FragmentDone
from protocol.gathered import Gathered

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
MEMBERS = 3
IN_TURN = 3
NUMEL = IN_TURN * 2**17
"""Three fragments in turn, each of two fragments at once of 64K values."""
ROUND = 7


def value(member: int, fragment: int) -> float:
    return float(10 * (fragment + 1) + member)


def run_round(*, late_s: float = 0.0, stops_before: int | None = None) -> list[dict[str, Any]]:
    """Each member's answers per fragment (the answer and the buffer's values after it) and its
    step's outcome (None if it failed). Member 2 opens each gate ``late_s`` after the others and,
    with ``stops_before``, never opens that fragment's gate or any after it."""
    first = DHT(start=True, host_maddrs=LOOPBACK)
    dhts = [first] + [
        DHT(start=True, host_maddrs=LOOPBACK, initial_peers=first.get_visible_maddrs()) for _ in range(MEMBERS - 1)
    ]
    averagers: list[ExactAverager] = []
    results: list[dict[str, Any]] = [{"fragments": {}, "outcome": None, "error": None} for _ in range(MEMBERS)]
    try:
        for dht in dhts:
            averager = ExactAverager(
                NUMEL,
                dht,
                codec=get_codec("none"),
                prefix="inturn",
                streams=2,
                sync_fragments=IN_TURN,
                start=False,
                min_group_size=MEMBERS,
                min_matchmaking_time=3.0,
                request_timeout=3.0,
                allreduce_timeout=12.0,
            )
            averager.run_in_background(await_ready=True)
            averager.set_sync_span(2.0)
            averagers.append(averager)

        def member(i: int) -> None:
            averager, out = averagers[i], results[i]
            buffer = averager.vector  # shared with the averager's process
            control = None
            try:
                for s, (start, end) in enumerate(averager.syncs):
                    if i == 2 and stops_before is not None and s >= stops_before:
                        break
                    if i == 2 and s > 0:
                        time.sleep(late_s)  # this member's host reaches each gate later
                    buffer[: end - start].fill_(value(i, s))
                    if control is None:
                        gather = Gathered(id=f"m{i}", round=ROUND, digest="d", samples=1).to_wire()
                        control = averager.step(weight=1.0, timeout=30, gather=gather, wait=False)
                    done: FragmentDone = averager.open_fragment(ROUND, s).result(timeout=60)
                    out["fragments"][s] = {"done": done, "values": buffer[: end - start].clone()}
                    if not done.averaged:
                        break
                assert control is not None
                out["outcome"] = control.result(timeout=60)
            except Exception as exc:  # noqa: BLE001 - a failed step: recorded
                out["error"] = exc

        threads = [threading.Thread(target=member, args=(i,), daemon=True) for i in range(MEMBERS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
            assert not thread.is_alive(), "a member's round did not end"
        return results
    finally:
        for averager in averagers:
            with contextlib.suppress(Exception):
                averager.shutdown()
        for dht in dhts:
            dht.shutdown()


def test_each_fragment_is_averaged_in_turn_through_a_buffer_one_fragment_long() -> None:
    results = run_round(late_s=1.0)
    bounds = [(0, 2**17), (2**17, 2 * 2**17), (2 * 2**17, NUMEL)]
    for i, out in enumerate(results):
        assert out["error"] is None, (i, out["error"])
        assert out["outcome"] is not None and not out["outcome"].failed, (i, out["outcome"])
        assert out["outcome"].stats.missing == []
        assert out["outcome"].stats.streams == IN_TURN * 2
        members = out["fragments"][0]["done"].members  # the group, to judge the round before landing any of it
        assert members is not None and sorted(m.id for m in members.values()) == ["m0", "m1", "m2"]
        assert all(out["fragments"][s]["done"].members is None for s in (1, 2))
        for s, (start, end) in enumerate(bounds):
            got = out["fragments"][s]
            done = got["done"]
            assert (done.index, done.start, done.end) == (s, start, end)
            assert done.averaged and done.missing == [], done
            assert done.bytes_sent > 0
            expected = sum(value(m, s) for m in range(MEMBERS)) / MEMBERS
            assert torch.equal(got["values"], torch.full((end - start,), expected)), (i, s, got["values"][:4])
            assert torch.equal(got["values"], results[0]["fragments"][s]["values"])


def test_a_member_that_never_writes_a_fragment_costs_the_others_only_its_share_of_it() -> None:
    results = run_round(stops_before=2)
    honest = results[:2]
    last = 2
    missing = honest[0]["fragments"][last]["done"].missing
    for i, out in enumerate(honest):
        assert out["error"] is None, (i, out["error"])
        for s in range(last):  # averaged with all three before it stopped
            got = out["fragments"][s]
            assert got["done"].averaged and got["done"].missing == []
            expected = sum(value(m, s) for m in range(MEMBERS)) / MEMBERS
            assert torch.equal(got["values"], torch.full_like(got["values"], expected))
        done = out["fragments"][last]["done"]
        assert done.averaged, done
        assert done.missing == missing and len(missing) >= 1, done.missing  # its reducer's range
        start = done.start
        kept = torch.ones(done.end - start, dtype=torch.bool)
        for lo, hi in done.missing:
            assert done.start <= lo < hi <= done.end
            kept[lo - start : hi - start] = False
        assert bool(kept.any())
        values = out["fragments"][last]["values"]
        without = (value(0, last) + value(1, last)) / 2  # its parts never came: the two honest members' mean
        assert torch.equal(values[kept], torch.full_like(values[kept], without))
        assert torch.equal(values[kept], honest[0]["fragments"][last]["values"][kept])
        assert out["outcome"] is not None
        assert sorted(map(tuple, out["outcome"].stats.missing)) == sorted(map(tuple, missing))
    stopped = results[2]
    assert stopped["outcome"] is None or stopped["outcome"].failed, stopped["outcome"]
