"""The step's parts: ranges around the package's functions, charged on the CPU."""

from __future__ import annotations

import sys

import pytest

import dampednewton._step.kronecker_refresh as kronecker_refresh
import dampednewton.math.kronecker_factors as kronecker_factors
from benchmarks.micro.step_parts import PARTS, labelled_parts, main


def test_the_parts_are_labelled_inside_and_restored_after():
    function = kronecker_factors.refreshed_values
    method = kronecker_factors.FactorEigenBatch.solve
    importers = [
        module
        for name, module in sys.modules.items()
        if name.startswith("dampednewton") and vars(module).get("refreshed_values")
    ]
    assert len(importers) > 1  # defined in one module, imported by name elsewhere
    with labelled_parts():
        for module in importers:
            assert module.refreshed_values is not function
            assert module.refreshed_values.__wrapped__ is function
        assert kronecker_factors.FactorEigenBatch.solve is not method
        assert kronecker_refresh.refreshed_layers.__name__ == "refreshed_layers"
    for module in importers:
        assert module.refreshed_values is function
    assert kronecker_factors.FactorEigenBatch.solve is method
    assert len({part for _, _, part in PARTS}) == len(PARTS)


@pytest.mark.slow
def test_the_table_charges_every_operator_of_both_steps_on_the_cpu(capsys):
    main(["--models", "mlp-tiny", "--threads", "1"])
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| mlp-tiny")
    ]
    steps = {
        kind: [row for row in rows if row[1] == kind]
        for kind in ("between", "rotating")
    }
    totals = {}
    for kind, parts in steps.items():
        *each, total = parts
        assert total[2] == "**step**"
        assert all(int(row[4]) > 0 for row in each), kind  # parts that ran ops only
        assert all(row[3] == "0" for row in parts)  # no kernels on the CPU
        totals[kind] = int(total[4])
    assert totals["rotating"] > 2 * totals["between"]
    rotating = {row[2] for row in steps["rotating"]}
    between = {row[2] for row in steps["between"]}
    # A rotation past the ramp: one subspace iteration per factor (Householder on
    # the CPU) and the Rayleigh quotients; none of it between refreshes.
    assert {"closure", "rotations.householder", "rayleigh"} <= rotating
    assert between.isdisjoint({"refresh", "rotations.householder", "rayleigh"})
