"""The waiting ranks' spin policy (mpitf/runtime/spin.py): pure, no MPI."""

import pytest

from mpitf.errors import ConfigurationError
from mpitf.runtime.spin import SpinPolicy


def test_a_new_policy_spins_the_floor():
    assert SpinPolicy().budget() == SpinPolicy.FLOOR


def test_short_waits_set_the_spin_to_twice_their_latency():
    policy = SpinPolicy()
    for _ in range(50):
        policy.ended(200e-6)  # e.g. a bucket's round trip
    assert abs(policy.budget() - 400e-6) < 1e-9


def test_waits_for_computation_do_not_lengthen_the_spin():
    policy = SpinPolicy()
    for _ in range(20):
        policy.ended(10e-6)  # a 4 KiB round trip
    before = policy.budget()
    for _ in range(100):
        policy.ended(30e-3)  # another worker's step: no message latency in it
    assert policy.budget() == before == SpinPolicy.FLOOR


def test_the_spin_never_exceeds_the_cap():
    policy = SpinPolicy()
    for _ in range(50):
        policy.ended(0.9 * policy.cap)
    assert policy.budget() == policy.cap


@pytest.mark.parametrize("text", ["soon", "-1", "nan", "inf"])
def test_a_spin_that_is_not_a_number_of_milliseconds_is_refused_by_name(text):
    with pytest.raises(ConfigurationError, match=f"MPITF_SPIN_MS='{text}' is not a number"):
        SpinPolicy.from_environment({"MPITF_SPIN_MS": text})


def test_an_empty_spin_is_the_adaptive_one():
    assert SpinPolicy.from_environment({"MPITF_SPIN_MS": " "}).fixed is None
    assert SpinPolicy.from_environment({"MPITF_SPIN_MS": "0"}).fixed == 0.0


def test_mpitf_spin_ms_fixes_the_spin(monkeypatch):
    monkeypatch.setenv("MPITF_SPIN_MS", "20")
    policy = SpinPolicy.from_environment()
    policy.ended(10e-6)
    assert policy.budget() == 0.02
    monkeypatch.delenv("MPITF_SPIN_MS")
    assert SpinPolicy.from_environment().fixed is None


def test_a_wait_for_many_bytes_spins_as_long_as_copying_them_takes():
    policy = SpinPolicy()
    assert policy.budget(4096) == SpinPolicy.FLOOR  # a small message: the learned spin
    two_16_mib = 2 * (16 << 20)  # a push and its reply
    assert policy.budget(two_16_mib) == two_16_mib / SpinPolicy.MOVE_RATE > policy.cap
    assert policy.budget(1 << 40) == SpinPolicy.MAX_MOVE
    policy.fixed = 0.02
    assert policy.budget(two_16_mib) == 0.02  # $MPITF_SPIN_MS decides alone
