"""The default step by phase: the schedule it names, and its table on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch
from backpack import extend
from torch import nn

from benchmarks.micro.step_phases import PERIOD, PHASES, main, step_kinds
from benchmarks.micro.step_profile import EigensolverCalls
from dampednewton import DampedNewton


def test_the_phases_are_those_the_default_optimizer_takes():
    generator = torch.Generator().manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(6, 40), nn.Tanh(), nn.Linear(40, 3)))
    loss_fn = extend(nn.CrossEntropyLoss())
    inputs = torch.randn(16, 6, generator=generator)
    targets = torch.randint(0, 3, (16,), generator=generator)
    optimizer = DampedNewton(model.parameters(), seed=0)

    def closure():
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss

    # What the optimizer did: a refresh counts an update, a rotation replaces the
    # eigenvectors (those of the input factor of 41 rows, larger than the kept rank
    # 32: never between). Only the ramp's five rotations solve eigenproblems.
    taken, updates, solving, vectors = [], 0, [], None
    weight = model[0].weight
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(3 * PERIOD + 1):
            with EigensolverCalls() as solves:
                optimizer.step(closure)
            now = optimizer.records["groups"][0]["curvature_updates"]
            refreshed, updates = now > updates, now
            stored = optimizer.state[weight]["kronecker_input_vectors"].clone()
            rotated = vectors is None or not torch.equal(stored, vectors)
            vectors = stored
            taken.append(
                ("rotating" if rotated else "refresh") if refreshed else "between"
            )
            solving.append(solves.count > 0)
    assert taken == step_kinds(3 * PERIOD + 1)
    assert [step for step, solved in enumerate(solving) if solved] == [0, 1, 3, 7, 15]
    period = taken[2 * PERIOD : 3 * PERIOD]
    # Every refresh rotates (rotation_interval=1): no refresh of values alone.
    assert [period.count(phase) for phase in PHASES] == [42, 0, 3]


@pytest.mark.slow
def test_the_phase_table_on_the_cpu(capsys):
    main(["--models", "mlp", "--variants", "default", "--periods", "1"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()]
    phases = {row[3].strip(): row for row in rows if len(row) > 3 and "mlp" in row[1]}
    # The defaults' period: no refresh that keeps the eigenvectors, so no such row.
    assert list(phases) == ["between", "rotating", "amortized"]
    assert [int(phases[phase][4]) for phase in ("between", "rotating")] == [42, 3]
    # A rotation adds the pass, the factors and their QRs (past the ramp).
    assert int(phases["between"][6]) < int(phases["rotating"][6])
    assert int(phases["between"][7]) == int(phases["rotating"][7]) == 1  # one read


@pytest.mark.cuda
def test_the_phase_table_on_the_device(capsys):
    main(["--models", "mlp", "--variants", "default", "--periods", "1"])
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()]
    phases = {row[3].strip(): row for row in rows if len(row) > 3 and "mlp" in row[1]}
    taken = ("between", "rotating")  # the defaults' period past the ramp
    syncs = {phase: int(phases[phase][8]) for phase in taken}
    # The one read in both phases: past the ramp a rotation runs QRs (no check of
    # their result) and no eigensolver (whose cuSOLVER check would synchronize).
    assert syncs == dict.fromkeys(taken, 1)
    assert int(phases["between"][6]) < int(phases["rotating"][6])  # kernels
