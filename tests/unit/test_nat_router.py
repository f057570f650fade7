"""The NAT lab's router rules (benchmarks.nat_router): what each Nat turns into."""

from __future__ import annotations

import pytest

from benchmarks.nat_router import Nat, nft_ruleset


def test_a_plain_nat_masquerades_and_forwards_nothing_in() -> None:
    rules = nft_ruleset(Nat(), public_if="pub0", inner_if="in0")
    assert 'oifname "pub0" masquerade' in rules
    assert "dnat to" not in rules
    assert "policy drop" in rules and "ct state established,related accept" in rules


def test_a_port_mapping_forwards_its_external_port_to_a_different_internal_one() -> None:
    rules = nft_ruleset(Nat(forwards={40123: 7700}), public_if="pub0", inner_if="in0")
    assert 'iifname "pub0" tcp dport 40123 counter dnat to 192.168.1.2:7700' in rules
    assert "ct status dnat accept" in rules


@pytest.mark.parametrize("forwards", [{0: 7700}, {40123: 70000}, {True: 7700}])
def test_ports_out_of_range_are_refused(forwards: dict) -> None:
    with pytest.raises(ValueError, match="1-65535"):
        Nat(forwards=forwards)
