"""Every layer in one padded batch (``KroneckerBasis(packed=True)``): the same steps.

The padded step's math is checked against each layer's dense solve in
``tests/test_kronecker_math.py``; here the packed optimizer trains every Kronecker
problem as the unpacked one does, through refreshes and the steps between them, with
fewer operators, a number that does not grow with the layers' shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from backpack import extend

from dampednewton import (
    CurvatureAveraging,
    DampedNewton,
    KroneckerBasis,
    LevenbergMarquardt,
    NoiseFilter,
)
from dampednewton._step.kronecker_group import LayerBatch
from dampednewton._step.kronecker_packed import (
    packable,
    padded_packs,
)
from dampednewton._step.kronecker_state import LayerBasis
from dampednewton.math.kronecker_factors import FactorEigen
from tests.case_models import wide_then_narrow_mlp
from tests.cases import KRONECKER_PROBLEMS, case_by_id
from tests.optimizer.test_kronecker_batches import BASES, ComputingOperators
from tests.utils import (
    assert_same_parameters,
    build_case,
    make_closure,
    train_twins,
)


def twins(
    problem,
    basis: dict,
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
    **settings,
):
    """The problem twice: unpacked, then packed (refreshes at 0, 1, 3, 6, 9, …)."""
    runs = []
    for packed in (False, True):
        case = build_case(problem, dtype, device)
        optimizer = DampedNewton(
            case.model.parameters(),
            basis=KroneckerBasis(**basis, packed=packed),
            averaging=CurvatureAveraging(interval=3),
            seed=0,
            **settings,
        )
        runs.append((optimizer, case))
    return runs


@pytest.mark.parametrize("basis", list(BASES.values()), ids=list(BASES))
@pytest.mark.parametrize("problem", KRONECKER_PROBLEMS, ids=lambda p: p.id)
def test_packed_steps_are_the_unpacked_steps(problem, basis):
    runs = twins(problem, basis)
    train_twins(runs, steps=10)
    (_, first), (packed, second) = runs
    assert packed.records["groups"][0]["curvature_updates"] == 5
    # Padded and unpadded products round differently.
    assert_same_parameters(second.model, first.model, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=str)
def test_packed_steps_on_the_device_and_for_a_half_precision_model(device, dtype):
    """A CNN on each device; bfloat16 gradients copied into the float32 buffer."""
    runs = twins(case_by_id("cnn-ce"), {"rank": 3, "exact_size": 4}, dtype, device)
    train_twins(runs, steps=6)
    (_, first), (_, second) = runs
    if dtype == torch.float64:
        assert_same_parameters(second.model, first.model, rtol=1e-12, atol=1e-13)
        return
    # float32 steps that round differently may land on neighbouring bfloat16 values:
    # one unit in the last place (2⁻⁷ relative) apart at most, after six steps.
    ulp = torch.finfo(dtype).eps
    for actual, expected in zip(
        second.model.parameters(), first.model.parameters(), strict=True
    ):
        assert actual.dtype == dtype
        gap = (actual.float() - expected.float()).abs()
        assert bool((gap <= ulp * expected.float().abs() + 1e-6).all()), gap.max()


def noise_filter() -> dict:
    return {"basis": {"noise_filter": NoiseFilter()}}


def adaptive_damping() -> dict:  # a policy of its own per optimizer: it adapts
    return {"basis": {}, "damping": LevenbergMarquardt(value=1e-2, interval=2)}


@pytest.mark.parametrize("settings", [noise_filter, adaptive_damping])
def test_steps_the_pack_cannot_take_are_taken_unpacked(settings):
    """A noise filter's moments and adaptive damping's curvatures: the same path."""
    problem = KRONECKER_PROBLEMS[0]
    first, second = twins(problem, **settings()), twins(problem, **settings())
    runs = [first[0], second[1]]  # unpacked and packed, each with its own policies
    train_twins(runs, steps=6)
    (_, unpacked), (_, packed) = runs
    assert_same_parameters(packed.model, unpacked.model, rtol=0, atol=0)


def test_a_layer_frozen_after_its_refreshes_steps_as_unpacked():
    """A frozen layer keeps its bases: it is packed, with a zero gradient."""
    problem = case_by_id("deep-mlp-ce")
    runs = twins(problem, {})
    train_twins(runs, steps=4)
    for _, case in runs:
        [m for m in case.model if isinstance(m, torch.nn.Linear)][1].requires_grad_(
            False
        )
    train_twins(runs, steps=4)
    (_, first), (_, second) = runs
    assert_same_parameters(second.model, first.model, rtol=1e-12, atol=1e-13)


def trained(
    model: torch.nn.Sequential, params: list[torch.nn.Parameter], basis: KroneckerBasis
) -> tuple[DampedNewton, Callable[[], torch.Tensor]]:
    """Six steps of ``params`` on a fixed batch of 8 (refreshes at 0, 1, 3, 5)."""
    generator = torch.Generator().manual_seed(1)
    features = model[0].in_features
    X = torch.randn(8, features, dtype=torch.float64, generator=generator)
    y = torch.randint(0, 2, (8,), generator=generator)
    optimizer = DampedNewton(
        params, basis=basis, averaging=CurvatureAveraging(interval=2), seed=0
    )
    closure = make_closure(optimizer, model, extend(torch.nn.CrossEntropyLoss()), X, y)
    for _ in range(6):
        optimizer.step(closure)
    return optimizer, closure


def test_a_bias_alone_and_a_weight_without_bias_are_packed():
    """The first layer's bias without its weight, a layer without bias."""
    runs = []
    for packed in (False, True):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(4, 5),
            torch.nn.Tanh(),
            torch.nn.Linear(5, 3, bias=False),
            torch.nn.Tanh(),
            torch.nn.Linear(3, 2),
        )
        model = extend(model.double())
        params = [model[0].bias, model[2].weight, model[4].weight, model[4].bias]
        trained(model, params, KroneckerBasis(packed=packed))
        runs.append(model)
    assert_same_parameters(runs[1], runs[0], rtol=1e-12, atol=1e-13)


def test_layers_of_two_dtypes_are_not_packed():
    def batch(dtype: torch.dtype) -> LayerBatch:
        eigen = FactorEigen(
            torch.ones(2, dtype=dtype),
            torch.eye(2, dtype=dtype),
            torch.zeros((), dtype=dtype),
            torch.ones((), dtype=dtype),
        )
        return LayerBatch([], eigen, eigen)

    assert packable([batch(torch.float32), batch(torch.float32)])
    assert not packable([batch(torch.float32), batch(torch.float64)])


def layer_batch(rows: int, columns: int, count: int = 1) -> LayerBatch:
    """``count`` layers ``Linear(columns, rows)`` in a batch (no eigenpairs needed)."""
    eigen = FactorEigen(
        torch.ones(1), torch.ones(1, 1), torch.zeros(()), torch.ones(())
    )
    layers = [
        LayerBasis(torch.zeros(rows, columns), torch.zeros(rows), eigen, eigen)
        for _ in range(count)
    ]
    return LayerBatch(layers, eigen, eigen)


def test_packs_bound_their_padding_largest_layers_first():
    # cifar10_3c3d's layers (with biases): one pack, 3.95 padded entries per own.
    shapes = [(64, 75), (96, 576), (128, 864), (512, 1152), (256, 512), (10, 256)]
    batches = [layer_batch(rows, columns) for rows, columns in shapes]
    assert padded_packs(batches) == [
        [batches[3], batches[4], batches[2], batches[1], batches[0], batches[5]]
    ]
    # A wide first layer and narrow ones (three of one shape stacked): two packs.
    wide, narrow, stacked = layer_batch(64, 6), layer_batch(3, 64), layer_batch(3, 3, 3)
    assert padded_packs([wide, narrow, stacked]) == [[wide], [narrow, stacked]]
    assert padded_packs([wide, narrow, stacked], limit=100.0) == [
        [wide, narrow, stacked]
    ]


def test_a_group_in_several_packs_steps_as_unpacked():
    """A wide first layer and narrow ones: two packs, fewer operators than unpacked."""
    runs = []
    for packed in (False, True):
        model = extend(wide_then_narrow_mlp(torch.Generator().manual_seed(0)))
        basis = KroneckerBasis(rank=4, exact_size=4, packed=packed)
        optimizer, closure = trained(model, list(model.parameters()), basis)
        with ComputingOperators() as operators:
            optimizer.step(closure)
        runs.append((model, operators.count))
        if packed:  # the wide layer, the narrow ones, the output layer
            assert len(optimizer._pipeline.kronecker._packs[0].packs) == 3
    (unpacked, by_shape), (packed_model, packed_count) = runs
    assert packed_count < by_shape
    assert_same_parameters(packed_model, unpacked, rtol=1e-12, atol=1e-13)


def test_a_loaded_state_rebuilds_the_pack():
    problem = KRONECKER_PROBLEMS[0]

    def packed(case):
        return DampedNewton(
            case.model.parameters(),
            basis=KroneckerBasis(packed=True),
            averaging=CurvatureAveraging(interval=3),
            seed=0,
        )

    case = build_case(problem)
    optimizer = packed(case)
    train_twins([(optimizer, case)], steps=4)
    resumed = packed(case)
    resumed.load_state_dict(optimizer.state_dict())
    train_twins([(resumed, case)], steps=4)
    uninterrupted = build_case(problem)
    train_twins([(packed(uninterrupted), uninterrupted)], steps=8)
    assert_same_parameters(case.model, uninterrupted.model, rtol=0, atol=0)


def operators_between_refreshes(widths: list[int], packed: bool) -> int:
    """Operators of a step between refreshes of a tanh MLP 6-w_1-…-w_k-3."""
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(10, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (10,), generator=generator)
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for fan_in, fan_out in zip([6, *widths], widths, strict=False):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.Tanh()]
    layers.append(torch.nn.Linear(widths[-1], 3))
    model = extend(torch.nn.Sequential(*layers).double())
    optimizer = DampedNewton(
        model.parameters(),
        basis=KroneckerBasis(rank=4, exact_size=4, packed=packed),
        averaging=CurvatureAveraging(interval=100, ramp=False),
    )
    closure = make_closure(optimizer, model, extend(torch.nn.CrossEntropyLoss()), X, y)
    optimizer.step(closure)  # the refresh
    optimizer.step(closure)  # the first step between refreshes builds the pack
    with ComputingOperators() as step:
        optimizer.step(closure)
    with ComputingOperators() as plain:
        closure()
    return step.count - plain.count


def test_a_packed_step_issues_as_many_operators_for_any_number_of_shapes():
    """Three or six layers of distinct shapes: the optimizer's own operators."""
    few = [operators_between_refreshes([8, 5], packed) for packed in (False, True)]
    many = [
        operators_between_refreshes([8, 5, 7, 9, 6], packed) for packed in (False, True)
    ]
    assert few[1] == many[1], (few, many)
    assert few[1] < few[0] < many[0], (few, many)
