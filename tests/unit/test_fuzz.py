"""Fuzzing (hypothesis) of everything that parses what another party sends: run specs, signed
envelopes, access tokens, DHT records, codec payloads and every coordinator RPC, fed random
and half-valid input. Each must answer with one of our errors (``SwarmtrainError``; a spec
with ``SpecError``) and change nothing; after the RPC fuzzing the coordinator still ticks,
serves its figures and grants an honest claim (issue #14). Bounded: a few thousand inputs
in all, no deadline per example (this machine is shared by parallel tests)."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from coordinator.core import Coordinator
from coordinator.http.metrics import render_metrics
from coordinator.store import Store, sqlite_url
from engine.codecs import get_codec
from protocol import coordinator_pb2 as pb
from protocol import kinds
from protocol.errors import MalformedTensorError, SpecError, SwarmtrainError
from protocol.identity import Identity
from protocol.membership import parse_revocations
from protocol.messages import SignedMessage, sign_message
from protocol.spec import parse_spec
from protocol.statesync import parse_digest_record
from protocol.tokens import TOKEN_KIND, decode_token

FUZZ = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
KINDS = [kinds.JOIN, kinds.HEARTBEAT, kinds.ROUND_REPORT, kinds.ADMIN, "swarmtrain.unknown.v1"]
COORDINATOR_KEY = Identity.generate()
NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.0, -1.0, 1e300, 2.0**62, 2.0**31, -(2.0**63)]),
)
INTS = st.one_of(st.integers(min_value=-(2**63), max_value=2**63 - 1), st.sampled_from([2**31, 2**62, -1]))


@given(text=st.text(max_size=400))
@FUZZ
def test_spec_parser_refuses_garbage_with_spec_errors(text: str) -> None:
    try:
        parse_spec(text)
    except SpecError:
        pass


@given(
    extra=st.lists(
        st.tuples(
            st.sampled_from(["run", "task.model", "inner", "rounds", "outer", "averaging", "credits", "admission"]),
            st.sampled_from(["name", "d_model", "lr", "inner_steps", "momentum", "clip", "streams", "mode", "x"]),
            st.one_of(NUMBERS.filter(math.isfinite), st.text(max_size=8), st.booleans(), st.integers(-5, 10**12)),
        ),
        max_size=4,
    )
)
@FUZZ
def test_spec_parser_refuses_bad_values_with_spec_errors(extra: list[tuple[str, str, object]]) -> None:
    lines = ['[run]\nname = "fuzz"']
    for section, key, value in extra:
        literal = repr(value).lower() if isinstance(value, bool) else repr(value).replace("'", '"')
        lines.append(f"[{section}]\n{key} = {literal}")
    try:
        parse_spec("\n".join(lines))
    except SpecError:
        pass


@given(data=st.binary(max_size=600))
@FUZZ
def test_envelopes_tokens_and_records_refuse_garbage(data: bytes) -> None:
    for parse in (
        SignedMessage.from_bytes,
        decode_token,
        lambda d: parse_digest_record(d, now=time.time()),
        lambda d: parse_revocations(d, coordinator_key=COORDINATOR_KEY.public_key, now=time.time()),
    ):
        try:
            parse(data)
        except SwarmtrainError:
            pass


@given(kind=st.sampled_from([*KINDS, TOKEN_KIND, kinds.REVOCATIONS]), body=st.binary(max_size=300))
@FUZZ
def test_validly_signed_garbage_bodies_are_refused(kind: str, body: bytes) -> None:
    raw = sign_message(Identity.generate(), kind, body, now=time.time()).to_bytes()
    for parse in (decode_token, lambda d: parse_digest_record(d, now=time.time())):
        try:
            parse(raw)
        except SwarmtrainError:
            pass


@given(codec=st.sampled_from(["none", "fp16", "int8", "4bit"]), data=st.binary(max_size=700), numel=st.integers(0, 300))
@FUZZ
def test_codecs_refuse_bad_payloads_or_decode_finite_values(codec: str, data: bytes, numel: int) -> None:
    try:
        values = get_codec(codec).decode(data, numel)
    except MalformedTensorError:
        return
    assert values.numel() == numel and bool(values.isfinite().all())


# ---------------------------------------------------------------------------- coordinator RPCs


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Coordinator, list[Identity]]]:
    """One coordinator core fuzzed by every RPC test below, and three admitted peers."""
    spec = '[run]\nname = "fuzz"\n'
    store = Store(sqlite_url(Path(tmp_path_factory.mktemp("fuzz"))))
    core = Coordinator(
        spec=parse_spec(spec), spec_toml=spec, identity=Identity.generate(), store=store, bootstrap_maddrs=[]
    )
    peers = [Identity.generate() for _ in range(3)]
    for peer in peers:
        body = pb.JoinBody(libp2p_peer_id="p", software_version="t", spec_digest=core.digest)
        core.join(sign_message(peer, kinds.JOIN, body.SerializeToString(), now=time.time()).to_proto(), now=time.time())
    yield core, peers
    store.close()


RPCS = {
    kinds.JOIN: lambda core, env, now: core.join(env, now=now),
    kinds.HEARTBEAT: lambda core, env, now: core.heartbeat(env, now=now),
    kinds.ROUND_REPORT: lambda core, env, now: core.report_round(env, now=now),
    kinds.ADMIN: lambda core, env, now: core.admin(env, now=now),
}


def call(core: Coordinator, kind: str, envelope: pb.SignedEnvelope) -> None:
    try:
        RPCS[kind](core, envelope, time.time())
    except (SwarmtrainError, ValueError):
        pass


@given(kind=st.sampled_from(list(RPCS)), raw=st.binary(max_size=400))
@FUZZ
def test_every_rpc_refuses_random_envelopes(fuzzed: tuple[Coordinator, list[Identity]], kind: str, raw: bytes) -> None:
    core, _ = fuzzed
    try:
        envelope = pb.SignedEnvelope.FromString(raw)
    except DecodeError:
        return  # the servicer answers INVALID_ARGUMENT before the core (test_grpc_fuzz)
    call(core, kind, envelope)


@given(kind=st.sampled_from(list(RPCS)), body=st.binary(max_size=400), member=st.integers(0, 2))
@FUZZ
def test_every_rpc_refuses_signed_garbage_bodies(
    fuzzed: tuple[Coordinator, list[Identity]], kind: str, body: bytes, member: int
) -> None:
    core, peers = fuzzed
    call(core, kind, sign_message(peers[member], kind, body, now=time.time()).to_proto())


@given(
    member=st.integers(0, 2),
    round_=INTS,
    samples=INTS,
    compute=NUMBERS,
    wait=NUMBERS,
    loss=NUMBERS,
    weight=NUMBERS,
    digest=st.text(max_size=40),
    offence=st.text(max_size=20),
    sps=NUMBERS,
)
@FUZZ
def test_reports_and_heartbeats_with_extreme_numbers(
    fuzzed: tuple[Coordinator, list[Identity]],
    member: int,
    round_: int,
    samples: int,
    compute: float,
    wait: float,
    loss: float,
    weight: float,
    digest: str,
    offence: str,
    sps: float,
) -> None:
    core, peers = fuzzed
    peer = peers[member]
    group = [pb.GroupMember(public_key=p.public_key.raw, weight=weight, offence=offence) for p in peers]
    report = pb.RoundReportBody(
        round=round_, samples=samples, compute_s=compute, wait_s=wait, loss=loss, state_digest=digest, group=group
    )
    call(
        core,
        kinds.ROUND_REPORT,
        sign_message(peer, kinds.ROUND_REPORT, report.SerializeToString(), now=time.time()).to_proto(),
    )
    beat = pb.HeartbeatBody(round=round_, samples_per_second=sps, samples_total=samples, loss=loss, state_digest=digest)
    call(
        core, kinds.HEARTBEAT, sign_message(peer, kinds.HEARTBEAT, beat.SerializeToString(), now=time.time()).to_proto()
    )


def test_after_the_fuzzing_the_coordinator_still_works(fuzzed: tuple[Coordinator, list[Identity]]) -> None:
    """Runs after the RPC fuzz tests (file order): the ticker, the figures and an honest round."""
    core, peers = fuzzed
    now = time.time()
    core.tick(now=now + 120)
    text = render_metrics(core, now=now + 120)
    assert "inf" not in text.lower().replace("info", "")
    round_ = 2**31 - 7  # a round no fuzzed report could have used up: rounds are per key
    for peer in peers:
        group = [pb.GroupMember(public_key=p.public_key.raw, weight=5.0) for p in peers]
        body = pb.RoundReportBody(round=round_, samples=5, compute_s=5.0, state_digest="good", group=group)
        envelope = sign_message(peer, kinds.ROUND_REPORT, body.SerializeToString(), now=now + 130)
        core.report_round(envelope.to_proto(), now=now + 130)
    core.tick(now=now + 200)
    assert all(c.status == "granted" for c in core.store.claims(round=round_)), core.store.claims(round=round_)
