"""The target's fingerprint: what tuning records and cached objects are keyed by."""

from __future__ import annotations

import dataclasses

import pytest

from compiler_core.target import Target, TargetError, host_target, parse_target

ZEN3 = Target(
    kind="llvm",
    cpu="znver3",
    features="+avx,+avx2,+fma,+f16c,+sse4.2,+bmi2,+sha,+pku,+wbnoinvd,-avx512f",
    triple="x86_64-unknown-linux-gnu",
    cores=2,
)


def test_features_a_hypervisor_hides_leave_the_fingerprint_alone():
    """Two VMs of one CPU differ in PKU and WBNOINVD, which no kernel uses: one machine's
    records must apply on both."""
    other_vm = dataclasses.replace(ZEN3, features="+avx,+avx2,+fma,+f16c,+sse4.2,+bmi2,+sha")
    assert other_vm.fingerprint == ZEN3.fingerprint


@pytest.mark.parametrize(
    "change",
    [
        {"features": ZEN3.features + ",+avx512f"},  # wider vectors
        {"features": ZEN3.features.replace("+fma,", "")},  # no FMA
        {"features": ZEN3.features + ",+amx-tile"},  # a server core under a client's name
        {"cpu": "znver4"},
        {"cores": 4},
    ],
)
def test_what_changes_the_code_or_its_speed_changes_the_fingerprint(change):
    assert dataclasses.replace(ZEN3, **change).fingerprint != ZEN3.fingerprint


def test_the_host_and_a_parsed_host_target_share_a_fingerprint():
    assert parse_target("llvm").fingerprint == host_target().fingerprint


def test_an_unknown_target_option_is_an_error():
    with pytest.raises(TargetError, match="-arch"):
        parse_target("cuda -arch")
