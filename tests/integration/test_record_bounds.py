"""DHT nodes of a run refuse oversized values under the run's keys (``engine.record_bounds``):
a real two-node hivemind DHT; the writer's store is refused by both nodes and a reader never
sees the value, while a record of normal size goes through and other keys are untouched."""

from __future__ import annotations

import pytest
from hivemind import DHT
from hivemind.utils.timed_storage import get_dht_time

from engine.record_bounds import MAX_DIGEST_RECORD_BYTES, MAX_SUBKEY_BYTES, RunRecordBounds
from protocol.identity import Identity
from protocol.statesync import digest_key, make_digest_record

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
PREFIX = "bounds-run"


@pytest.fixture(scope="module")
def dhts() -> tuple[DHT, DHT]:
    first = DHT(start=True, host_maddrs=LOOPBACK, record_validators=[RunRecordBounds(PREFIX)])
    second = DHT(
        start=True,
        host_maddrs=LOOPBACK,
        initial_peers=first.get_visible_maddrs(),
        record_validators=[RunRecordBounds(PREFIX)],
    )
    yield first, second
    second.shutdown()
    first.shutdown()


def test_a_normal_digest_record_is_stored_and_read(dhts: tuple[DHT, DHT]) -> None:
    writer, reader = dhts
    identity = Identity.generate()
    record = make_digest_record(identity, round_=3, digest="sha256:" + "a" * 64, now=get_dht_time())
    assert writer.store(digest_key(PREFIX), record, get_dht_time() + 60, subkey=identity.public_key.id)
    found = reader.get(digest_key(PREFIX), latest=True)
    assert found is not None and identity.public_key.id in found.value


@pytest.mark.parametrize(
    ("value", "subkey"),
    [
        (b"x" * (MAX_DIGEST_RECORD_BYTES + 1), "ed25519:big"),
        (b"x" * 10, "s" * (MAX_SUBKEY_BYTES + 1)),
    ],
    ids=["oversized-value", "oversized-subkey"],
)
def test_oversized_records_under_the_runs_keys_are_refused(dhts: tuple[DHT, DHT], value: bytes, subkey: str) -> None:
    writer, reader = dhts
    assert not writer.store(digest_key(PREFIX), value, get_dht_time() + 60, subkey=subkey)
    found = reader.get(digest_key(PREFIX), latest=True)
    assert found is None or subkey not in found.value


def test_a_value_without_a_subkey_under_a_run_key_is_refused(dhts: tuple[DHT, DHT]) -> None:
    writer, _ = dhts
    assert not writer.store(digest_key(PREFIX) + "", b"plain", get_dht_time() + 60)


def test_other_keys_are_left_to_hivemind(dhts: tuple[DHT, DHT]) -> None:
    writer, reader = dhts
    assert writer.store("someone-elses-key", b"y" * 10_000, get_dht_time() + 60)
    found = reader.get("someone-elses-key", latest=True)
    assert found is not None and found.value == b"y" * 10_000
