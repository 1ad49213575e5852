"""The Kronecker basis beyond its update rule (float64).

Partial layers, gradient accumulation, checkpoints between refreshes, refused batches
and settings, and what the exact size keeps.
"""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import Tensor, nn

from dampednewton import (
    CurvatureAveraging,
    DampedNewton,
    GramBasis,
    KroneckerBasis,
    NoiseAwareDamping,
    NoiseFilter,
)
from dampednewton._step.kronecker_moments import MOMENT_KEYS
from dampednewton._step.kronecker_state import OUTPUT_FACTOR
from tests.assertions import assert_close
from tests.cases import case_by_id
from tests.optimizer.kronecker_twin import (
    EXACT,
    assert_models_close,
    gradient_matrix,
    layers_of,
    reference_gradients,
)
from tests.reference.ggn import ggn
from tests.reference.kronecker import kfac_direction, kronecker_factors
from tests.utils import (
    Case,
    assert_parameters_equal,
    assert_same_state,
    build_case,
    make_closure,
    saved_counters,
    snapshot,
)


def test_a_layer_without_its_bias_and_a_bias_without_its_layer():
    """A frozen bias leaves its weight without the 1; a bias alone takes its GGN."""
    case = build_case(case_by_id("mlp-ce"))
    first, second = layers_of(case.model)
    first.bias.requires_grad_(False)
    second.weight.requires_grad_(False)
    damping = 0.01
    optimizer = DampedNewton(
        case.model.parameters(), damping=damping, averaging=None, **EXACT
    )
    reference_first, reference_second = layers_of(case.reference_model)
    inputs, outputs = kronecker_factors(
        case.reference_model,
        case.reference_loss_fn,
        reference_first,
        case.X,
        case.y,
        bias=False,
    )
    bias_ggn = ggn(
        case.reference_model,
        case.reference_loss_fn,
        [reference_second.bias],
        case.X,
        case.y,
    )
    reference_gradients(case)
    weight_step = kfac_direction(
        inputs, outputs, gradient_matrix(reference_first, bias=False), damping
    )
    ones = torch.ones(1, 1, dtype=torch.float64)
    bias_step = kfac_direction(
        ones, bias_ggn, reference_second.bias.grad[:, None], damping
    )
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    with torch.no_grad():
        reference_first.weight += weight_step.reshape(reference_first.weight.shape)
        reference_second.bias += bias_step[:, 0]
    assert_models_close(case)
    assert_close(optimizer.state[second.bias][OUTPUT_FACTOR], bias_ggn, rtol=1e-10)


def test_gradient_accumulation_gives_the_batch_factors_and_step():
    whole, parts = (build_case(case_by_id("cnn-ce")) for _ in range(2))
    settings = {"damping": 0.01, "averaging": None, **EXACT}
    optimizers = [
        DampedNewton(c.model.parameters(), **settings) for c in (whole, parts)
    ]
    optimizers[0].step(
        make_closure(optimizers[0], whole.model, whole.loss_fn, whole.X, whole.y)
    )

    def accumulated() -> Tensor:
        optimizers[1].zero_grad()
        total = 0.0
        for indices in (torch.tensor([0, 1]), torch.tensor([2, 3])):
            loss = parts.loss_fn(parts.model(parts.X[indices]), parts.y[indices]) / 2
            loss.backward()
            total = total + loss.detach()
        return total

    optimizers[1].step(accumulated)
    for actual, expected in zip(
        parts.model.parameters(), whole.model.parameters(), strict=True
    ):
        assert_close(actual, expected, rtol=1e-9, atol=1e-12)


BASES = [KroneckerBasis(), KroneckerBasis(noise_filter=NoiseFilter(0.9, 0.8))]
"""The default basis and, with its moments in the state, the noise filter."""
BASIS_IDS = ["kronecker", "noise-filter"]


@pytest.mark.parametrize("basis", BASES, ids=BASIS_IDS)
def test_state_dict_resumes_between_refreshes_bitwise(basis):
    runs = [build_case(case_by_id("cnn-wide-ce")) for _ in range(2)]
    averaging = CurvatureAveraging(decay=0.9, interval=4, ramp=False)

    def optimizer_of(case: Case) -> DampedNewton:
        return DampedNewton(
            case.model.parameters(),
            basis=basis,
            averaging=averaging,
            momentum=0.5,
            seed=3,
        )

    first = optimizer_of(runs[0])
    closure = make_closure(first, runs[0].model, runs[0].loss_fn, runs[0].X, runs[0].y)
    for _ in range(2):
        first.step(closure)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    with torch.no_grad():
        for target, source in zip(
            runs[1].model.parameters(), runs[0].model.parameters(), strict=True
        ):
            target.copy_(source)
    second = optimizer_of(runs[1])
    second.load_state_dict(torch.load(buffer, weights_only=True))
    other = make_closure(second, runs[1].model, runs[1].loss_fn, runs[1].X, runs[1].y)
    for _ in range(5):  # across the refresh at step 4
        first.step(closure)
        second.step(other)
    assert_parameters_equal(
        list(runs[1].model.parameters()), list(runs[0].model.parameters())
    )
    assert_same_state(snapshot(second), snapshot(first))


@pytest.mark.parametrize("basis", BASES, ids=BASIS_IDS)
@pytest.mark.parametrize("refresh", [True, False], ids=["refresh", "between"])
def test_a_non_finite_batch_leaves_no_trace(refresh, basis):
    case = build_case(case_by_id("mlp-ce"))
    averaging = CurvatureAveraging(interval=2, ramp=False)
    optimizer = DampedNewton(
        case.model.parameters(),
        basis=basis,
        averaging=averaging,
        nonfinite="skip",
        seed=0,
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    optimizer.step(closure)  # step 0 refreshes, step 1 does not, step 2 does
    if refresh:
        optimizer.step(closure)
    before = snapshot(optimizer)
    if basis.noise_filter is not None:
        assert MOMENT_KEYS <= set(before["state"][0])
    params = [p.detach().clone() for p in case.model.parameters()]
    bad = case.X.clone()
    bad[0, 0] = math.nan
    with pytest.warns(RuntimeWarning, match="refused"):
        optimizer.step(make_closure(optimizer, case.model, case.loss_fn, bad, case.y))
    assert_parameters_equal(list(case.model.parameters()), params)
    saved_counters(before)["skipped_steps"] += 1  # counted, nothing else
    assert_same_state(snapshot(optimizer), before)


def test_an_undamped_step_along_a_zero_eigenvalue_names_the_damping():
    """N = 4 samples, layers of 5 and more inputs: the factors are rank-deficient."""
    case = build_case(case_by_id("mlp-ce"))
    optimizer = DampedNewton(case.model.parameters(), damping=0.0, mc_samples=0)
    params = [p.detach().clone() for p in case.model.parameters()]
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    with pytest.raises(
        FloatingPointError, match=r"group 0 has damping=0.*Use a damping > 0"
    ):
        optimizer.step(closure)
    assert_parameters_equal(list(case.model.parameters()), params)


def test_unsupported_layers_name_the_gram_basis():
    case = build_case(case_by_id("mlp-ce"))
    model = nn.Sequential(case.model, nn.BatchNorm1d(3).double().eval())
    from backpack import extend

    model = extend(model)
    optimizer = DampedNewton(model.parameters())
    closure = make_closure(optimizer, model, case.loss_fn, case.X, case.y)
    with pytest.raises(NotImplementedError, match="basis=GramBasis"):
        optimizer.step(closure)


def test_refused_settings_say_what_to_do():
    params = [nn.Parameter(torch.zeros(2, 2))]
    with pytest.raises(ValueError, match="same kind of basis"):
        DampedNewton(
            [
                {"params": params[:1]},
                {"params": [nn.Parameter(torch.zeros(1))], "basis": GramBasis()},
            ]
        )
    with pytest.raises(ValueError, match="GramBasis"):
        DampedNewton(params, damping=NoiseAwareDamping(0.1), averaging=None)
    with pytest.raises(ValueError, match="rank >= 1"):
        KroneckerBasis(rank=0)
    with pytest.raises(ValueError, match="rotation_interval >= 1"):
        KroneckerBasis(rotation_interval=0)
    for solved in (-1, 2.0, True):
        with pytest.raises(ValueError, match="solved_rotations=None or an integer"):
            KroneckerBasis(solved_rotations=solved)
    assert [KroneckerBasis(solved_rotations=2).solves(r) for r in range(4)] == [
        True,
        True,
        False,
        False,
    ]
    assert KroneckerBasis(solved_rotations=None).solves(10**6)
    with pytest.raises(TypeError, match="rank >= 1"):
        KroneckerBasis(rank=2.5)
    with pytest.raises(ValueError, match="exact_size >= 0"):
        KroneckerBasis(exact_size=-1)
    with pytest.raises(TypeError, match=r"packed=True, False or None \(by device\)"):
        KroneckerBasis(packed=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="graphed=True, False or None"):
        KroneckerBasis(packed=True, graphed="yes")  # type: ignore[arg-type]
    with pytest.raises(
        ValueError, match=r"needs the layers packed.*packed=True, graph"
    ):
        KroneckerBasis(packed=False, graphed=True)
    with pytest.raises(TypeError, match="basis must be"):
        DampedNewton(params, basis="kronecker")


def test_factors_up_to_the_exact_size_keep_every_eigenvector():
    basis = KroneckerBasis(rank=3, exact_size=5)
    assert [basis.kept(dim) for dim in (2, 5, 6, 100)] == [2, 5, 3, 3]
    assert KroneckerBasis(rank=8, exact_size=0).kept(4) == 4


def test_the_step_keeps_what_the_exact_size_decides():
    """Linear(5, 4) then Linear(4, 3): input factors of 6 and 5 dimensions."""
    case = build_case(case_by_id("mlp-ce"))
    first, second = layers_of(case.model)
    optimizer = DampedNewton(
        case.model.parameters(), basis=KroneckerBasis(rank=2, exact_size=5)
    )
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    kept = [
        (
            optimizer.state[layer.weight]["kronecker_input_vectors"].shape[1],
            optimizer.state[layer.weight]["kronecker_output_vectors"].shape[1],
        )
        for layer in (first, second)
    ]
    assert kept == [(2, 4), (5, 3)]
