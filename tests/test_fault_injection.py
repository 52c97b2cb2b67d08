"""The fault-injection switches (deployments/faults.py) parse as documented and refuse other shapes."""

from __future__ import annotations

import pytest

from deployments.faults import RANK_EXIT_ENV, RANK_FAULT_ENV, parse_rank_exit, parse_rank_fault, rank_exit, rank_fault
from tests.helpers import batch_of, flux_params


@pytest.mark.parametrize("spec, parsed", [
    (None, None), ("", None),
    ("1:steps=7 ", (1, "steps=7 ", 1)),
    ("0:steps=97 @90", (0, "steps=97 ", 90)),
    ("2:a:b@3", (2, "a:b", 3)),
])
def test_rank_fault_specs(spec, parsed):
    assert parse_rank_fault(spec) == parsed


@pytest.mark.parametrize("spec", ["steps", "x:steps", ":steps", "1:", "1:steps@", "1:steps@0", "1:steps@x",
                                  "-1:steps", "1:@3"])
def test_malformed_rank_fault_specs_are_refused_naming_the_variable(spec):
    with pytest.raises(ValueError, match=RANK_FAULT_ENV):
        parse_rank_fault(spec)


def test_a_rank_fault_raises_after_its_step_and_keeps_the_callback(monkeypatch):
    batch = batch_of(flux_params("p", 1, steps=5, size=(64, 64)))
    seen = []
    monkeypatch.setenv(RANK_FAULT_ENV, "0:steps=5 @3")
    record = seen.append
    assert rank_fault(1, batch, record) is record  # another rank: unchanged
    fail = rank_fault(0, batch, lambda done, total: seen.append(done))
    fail(1, 5)
    fail(2, 5)
    with pytest.raises(RuntimeError, match="after step 3"):
        fail(3, 5)
    assert seen == [1, 2, 3]
    monkeypatch.delenv(RANK_FAULT_ENV)
    assert rank_fault(0, batch) is None


@pytest.mark.parametrize("spec, parsed", [(None, None), ("", None), ("1:steps=7 ", (1, "steps=7 ")),
                                          ("3:a:b@2", (3, "a:b@2"))])
def test_rank_exit_specs(spec, parsed):
    assert parse_rank_exit(spec) == parsed


@pytest.mark.parametrize("spec", ["steps", "0:steps", "-1:steps", "x:steps", ":steps", "1:"])
def test_malformed_rank_exit_specs_are_refused_naming_the_variable(spec):
    with pytest.raises(ValueError, match=RANK_EXIT_ENV):
        parse_rank_exit(spec)


def test_a_rank_exit_matches_its_rank_and_signature_only(monkeypatch):
    batch = batch_of(flux_params("p", 1, steps=5, size=(64, 64)))
    monkeypatch.setenv(RANK_EXIT_ENV, "1:steps=5 ")
    assert rank_exit(1, batch) and not rank_exit(2, batch)
    assert not rank_exit(1, batch_of(flux_params("p", 1, steps=6, size=(64, 64))))
    monkeypatch.delenv(RANK_EXIT_ENV)
    assert not rank_exit(1, batch)
