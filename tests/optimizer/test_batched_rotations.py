"""The GPU's batched rotations in the optimizer, run on the CPU: the same training.

On a GPU a rotating refresh past the ramp's eigensolves rotates every factor's basis
in one padded batch (:class:`~dampednewton.math.kronecker_rotation.RotationBatch`,
checked against a Gram-Schmidt reference in ``tests/test_kronecker_rotation.py``);
on the CPU each factor by Householder's QR. Forced on the CPU here, the batched route
must train as the CPU's does: the two differ only by its shift (``ε = 1e-8`` of
``‖F V‖_F`` in the subspace iteration) and round-off.
"""

from __future__ import annotations

from dampednewton import CurvatureAveraging, DampedNewton, KroneckerBasis
from dampednewton._step import kronecker_refresh
from dampednewton.math import kronecker_rotation
from tests.cases import case_by_id
from tests.utils import assert_same_parameters, build_case, train_twins


def optimizer_for(case) -> DampedNewton:
    return DampedNewton(
        case.model.parameters(),
        # Truncated factors of several dimensions and one whole (the output's 3):
        # padded batches of 4 columns and of 3; a refresh on every step, the
        # eigenvectors rotated without an eigensolver after the first five.
        basis=KroneckerBasis(rank=4, exact_size=0),
        averaging=CurvatureAveraging(interval=1, ramp=False),
        seed=0,  # the same Monte-Carlo samples in both runs
    )


def test_batched_rotations_train_as_the_cpus(monkeypatch):
    cpu = build_case(case_by_id("cnn-wide-ce"))
    train_twins([(optimizer_for(cpu), cpu)], steps=14)
    batched = build_case(case_by_id("cnn-wide-ce"))
    rotations: list[int] = []

    class BatchedEverywhere(kronecker_rotation.RotationBatch):
        """The GPU's route on any device, its rotations counted."""

        def __init__(self, batched: bool | None = None) -> None:
            super().__init__(batched=True)

        def solve(self):
            solved = super().solve()
            rotations.append(len(solved))
            return solved

    monkeypatch.setattr(kronecker_refresh, "RotationBatch", BatchedEverywhere)
    optimizer = optimizer_for(batched)
    train_twins([(optimizer, batched)], steps=14)
    # 14 refreshes: the first five solve eigenproblems, the other nine rotate the
    # four factors of the two layers.
    assert rotations == [0] * 5 + [4] * 9
    assert optimizer.records["groups"][0]["curvature_updates"] == 14
    # Nine rotations apart, the routes differ by the shift (ε = 1e-8: the parameters
    # by 8e-9 at most, each rotation's share about 1e-9) and round-off.
    assert_same_parameters(batched.model, cpu.model, rtol=1e-6, atol=1e-7)
    differences = [
        (a - b).abs().max()
        for a, b in zip(batched.model.parameters(), cpu.model.parameters(), strict=True)
    ]
    assert max(differences) > 0  # the batched route ran
