"""The packs' buffers outlive refreshes (``KroneckerBasis(packed=True)``).

A refresh whose layers keep their shapes copies its eigenpairs into the pack's padded
buffers (what a recorded CUDA graph reads), a new damping its coefficients: the same
steps as a pack built anew, a refill undone by the next one (a refused step's), a
misfit (other ranks, layers, dtype or layout) refused with nothing changed, and the
coefficients of every layer at once, in as many operators for any number of shapes.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dampednewton import CurvatureAveraging, DampedNewton, KroneckerBasis
from dampednewton._step.kronecker_group import LayerBatch
from dampednewton._step.kronecker_packed import PackedGroup, PackedLayers
from dampednewton._step.kronecker_state import LayerBasis
from dampednewton.math.kronecker_factors import EIGEN_FIELDS, FactorEigen
from tests.cases import KRONECKER_PROBLEMS, case_by_id
from tests.optimizer.test_kronecker_batches import BASES, ComputingOperators
from tests.optimizer.test_kronecker_packed import twins
from tests.utils import assert_same_parameters, build_case, make_closure, train_twins


def pack_buffers(pack: PackedLayers) -> list[torch.Tensor]:
    """The padded eigenpairs a pack's math reads."""
    return [
        getattr(side, name)
        for side in (pack.output, pack.inputs)
        for name in EIGEN_FIELDS
    ]


def test_a_refresh_refills_the_packs_buffers():
    """Refreshes at 3, 6, 9: the packs and their memory stay, their values follow."""
    runs = twins(KRONECKER_PROBLEMS[0], BASES["mixed"])
    train_twins(runs, steps=2)
    (_, first), (packed, second) = runs
    group = packed._pipeline.kronecker._packs[0]
    pack = group.packs[0]
    addresses = [buffer.data_ptr() for buffer in pack_buffers(pack)]
    stale = [buffer.clone() for buffer in pack_buffers(pack)]
    train_twins(runs, steps=8)
    assert packed.records["groups"][0]["curvature_updates"] == 5
    assert packed._pipeline.kronecker._packs[0] is group
    assert [buffer.data_ptr() for buffer in pack_buffers(pack)] == addresses
    fresh = PackedLayers(pack.batches)
    for buffer, expected in zip(pack_buffers(pack), pack_buffers(fresh), strict=True):
        assert torch.equal(buffer, expected)
    assert not all(map(torch.equal, pack_buffers(pack), stale))
    assert_same_parameters(second.model, first.model, rtol=1e-12, atol=1e-13)


def random_batch(layer: torch.nn.Linear, rank: int, seed: int) -> LayerBatch:
    """A layer's batch with random eigenpairs of its factors (``rank`` kept)."""
    generator = torch.Generator().manual_seed(seed)

    def eigen(dim: int) -> FactorEigen:
        kept = min(rank, dim)
        vectors, _ = torch.linalg.qr(
            torch.randn(dim, kept, generator=generator, dtype=torch.float64)
        )
        values = torch.rand(kept, generator=generator, dtype=torch.float64) + 1
        residual = torch.rand((), generator=generator, dtype=torch.float64)
        return FactorEigen(values, vectors, residual, values.mean())

    basis = LayerBasis(
        layer.weight,
        layer.bias,
        eigen(layer.out_features),
        eigen(layer.in_features + 1),
    )
    return LayerBatch([basis], basis.output, basis.inputs)


def to_float32(eigen: FactorEigen) -> FactorEigen:
    return FactorEigen(*(getattr(eigen, name).float() for name in EIGEN_FIELDS))


def test_a_refill_is_undone_by_the_next_one_and_a_misfit_changes_nothing():
    """A failed refresh step's eigenpairs are replaced by the restored ones."""
    torch.manual_seed(0)
    layers = [torch.nn.Linear(5, 4).double(), torch.nn.Linear(4, 3).double()]
    for layer in layers:
        for param in layer.parameters():
            param.grad = torch.randn_like(param)
    kept = [random_batch(layer, 2, seed) for seed, layer in enumerate(layers)]
    refused = [random_batch(layer, 2, seed + 7) for seed, layer in enumerate(layers)]
    group = PackedGroup(kept)
    expected = [direction.clone() for _, direction in group.step(0.1).directions]
    assert group.refill(refused, graphed=False)
    assert not torch.equal(group.step(0.1).directions[0][1], expected[0])
    assert group.refill(kept, graphed=False)
    for (_, direction), reference in zip(
        group.step(0.1).directions, expected, strict=True
    ):
        assert torch.equal(direction, reference)
    before = [buffer.clone() for buffer in pack_buffers(group.packs[0])]
    other_rank = [random_batch(layer, 3, seed) for seed, layer in enumerate(layers)]
    assert not group.refill(other_rank, graphed=False)
    single = [
        LayerBatch(
            batch.layers, *(to_float32(side) for side in (batch.output, batch.inputs))
        )
        for batch in kept
    ]
    assert not group.refill(single, graphed=False)
    assert not group.refill(kept[:1], graphed=False)
    assert not group.refill(kept, graphed=True)
    assert all(map(torch.equal, pack_buffers(group.packs[0]), before))


def test_a_refresh_step_refused_for_a_non_finite_batch_leaves_the_pack_usable():
    """A packed run that refused a batch at a refresh goes on as if it never saw it."""
    runs = []
    for skip in (False, True):
        case = build_case(case_by_id("mlp-ce"))
        optimizer = DampedNewton(
            case.model.parameters(),
            basis=KroneckerBasis(packed=True),
            averaging=CurvatureAveraging(interval=2, ramp=False),
            nonfinite="skip",
            seed=0,
        )
        closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
        for _ in range(2):  # a refresh at step 0, a step between
            optimizer.step(closure)
        if skip:  # what would be the refresh at step 2, refused
            bad = case.X.clone()
            bad[0, 0] = math.nan
            with pytest.warns(RuntimeWarning, match="refused"):
                optimizer.step(
                    make_closure(optimizer, case.model, case.loss_fn, bad, case.y)
                )
        for _ in range(5):
            optimizer.step(closure)
        runs.append(case.model)
    assert_same_parameters(runs[1], runs[0], rtol=0, atol=0)


def test_a_packs_coefficients_issue_as_many_operators_for_any_number_of_shapes():
    """Every layer's coefficients at once from the padded eigenpairs (a refresh's)."""
    counts = []
    for widths in ([6, 8, 5], [6, 8, 5, 7, 9, 4]):
        torch.manual_seed(0)
        layers = [
            torch.nn.Linear(fan_in, fan_out).double()
            for fan_in, fan_out in itertools.pairwise(widths)
        ]
        pack = PackedLayers(
            [random_batch(layer, 3, k) for k, layer in enumerate(layers)]
        )
        with ComputingOperators() as operators:
            pack.coefficients(0.1)
        counts.append(operators.count)
    assert counts[0] == counts[1], counts
