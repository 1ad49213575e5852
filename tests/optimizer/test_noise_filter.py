"""The noise filter's steps against a dense float64 reference, and its state.

The reference keeps each layer's moments as dense vectors over the directions
``u_i ⊗ v_j`` (``torch.kron`` of the eigenvectors the optimizer stored), rotates them
with the dense change of basis on every refresh and solves the filtered, damped
Kronecker step per direction; the gradients come from the plain twin model. A
refused step and a checkpoint with the filter's moments are covered with the plain
basis' (``test_kronecker_robustness.py``, parametrized over both).
"""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from torch import Tensor

from dampednewton import (
    CurvatureAveraging,
    DampedNewton,
    GramBasis,
    KroneckerBasis,
    LevenbergMarquardt,
    NoiseFilter,
)
from tests.cases import KRONECKER_PROBLEMS, case_by_id
from tests.optimizer.kronecker_twin import (
    EXACT,
    assert_models_close,
    gradient_matrix,
    layers_of,
    reference_gradients,
)
from tests.utils import (
    Case,
    assert_same_parameters,
    build_case,
    make_closure,
    train_twins,
)

FILTER = NoiseFilter(beta1=0.9, beta2=0.8, floor=0.1)
DAMPING = 0.01


def eigenpairs(optimizer: DampedNewton, layer) -> tuple[Tensor, ...]:
    """The layer's stored ``(τ, U, σ, V)`` (after a step: the ones it used)."""
    entry = optimizer.state[layer.weight]
    return tuple(
        entry[f"kronecker_{side}_{name}"].clone()
        for side in ("output", "input")
        for name in ("values", "vectors")
    )


class DenseFilter:
    """One layer's filtered step with dense moments over all its directions."""

    def __init__(self, noise_filter: NoiseFilter) -> None:
        self.filter = noise_filter
        self.first: Tensor | None = None
        self.second: Tensor | None = None
        self.count = 0
        self.basis: Tensor | None = None

    def step(self, gradient: Tensor, pairs: tuple[Tensor, ...]) -> Tensor:
        out_values, out_vectors, in_values, in_vectors = pairs
        basis = torch.kron(out_vectors, in_vectors)  # columns u_i ⊗ v_j
        gamma = basis.T @ gradient.flatten()
        beta1, beta2 = self.filter.beta1, self.filter.beta2
        if self.first is None:
            self.first = torch.zeros_like(gamma)
            self.second = torch.zeros_like(gamma)
        elif self.basis is not None:
            change = basis.T @ self.basis
            self.first = change @ self.first
            self.second = change.square() @ self.second
        self.basis = basis
        self.count += 1
        self.first = beta1 * self.first + (1 - beta1) * gamma
        self.second = beta2 * self.second + (1 - beta2) * gamma.square()
        mean = self.first.abs() / (1 - beta1**self.count)
        spread = (self.second / (1 - beta2**self.count)).sqrt()
        scales = (mean / spread).clamp(min=self.filter.floor, max=1.0)
        # K-FAC's factored damping: (τ_i + √δ/π)(σ_j + π√δ), π from the traces.
        pi = math.sqrt(in_values.mean() / out_values.mean())
        root = math.sqrt(DAMPING)
        damped = torch.kron(out_values + root / pi, in_values + root * pi)
        step = -(basis @ (scales * gamma / damped))
        return step.reshape(gradient.shape)


@pytest.mark.parametrize("problem_id", ["mlp-ce", "deep-mlp-ce"])
def test_filtered_steps_and_refreshes_match_the_dense_reference(problem_id):
    """Refreshes with new eigenvectors at steps 0, 2, 4; steps 1, 3 in between.

    The deep MLP's two hidden layers of one shape keep their moments stacked.
    """
    case = build_case(case_by_id(problem_id))
    basis = KroneckerBasis(exact_size=1000, rotation_interval=1, noise_filter=FILTER)
    optimizer = DampedNewton(
        case.model.parameters(),
        **{**EXACT, "basis": basis},
        damping=DAMPING,
        averaging=CurvatureAveraging(decay=0.5, interval=2, ramp=False),
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    layers, twins = layers_of(case.model), layers_of(case.reference_model)
    dense = [DenseFilter(FILTER) for _ in layers]
    for step in range(5):
        optimizer.step(closure)
        reference_gradients(case)
        with torch.no_grad():
            for layer, twin, reference in zip(layers, twins, dense, strict=True):
                direction = reference.step(
                    gradient_matrix(twin), eigenpairs(optimizer, layer)
                )
                width = twin.weight[0].numel()
                twin.weight += direction[:, :width].reshape(twin.weight.shape)
                twin.bias += direction[:, width]
        assert_models_close(case, rtol=1e-9)
        for layer, reference in zip(layers, dense, strict=True):
            entry = optimizer.state[layer.weight]
            assert entry["noise_filter_first_weight"] == pytest.approx(
                1 - FILTER.beta1 ** (step + 1), rel=1e-14
            )
            assert_close_moments(entry, reference)


def assert_close_moments(entry: dict, reference: DenseFilter) -> None:
    shape = entry["noise_filter_first_moment"].shape
    assert reference.first is not None and reference.second is not None
    torch.testing.assert_close(
        entry["noise_filter_first_moment"],
        reference.first.reshape(shape),
        rtol=1e-9,
        atol=1e-12,
    )
    torch.testing.assert_close(
        entry["noise_filter_second_moment"],
        reference.second.reshape(shape),
        rtol=1e-9,
        atol=1e-14,
    )


@pytest.fixture(params=KRONECKER_PROBLEMS, ids=lambda problem: problem.id)
def twins(request) -> tuple[Case, Case]:
    return build_case(request.param), build_case(request.param)


@pytest.mark.parametrize("damping", ["constant", "lm"])
def test_a_floor_of_one_is_the_plain_step(twins, damping):
    """``ρ ≥ 1`` everywhere: the same parameters as without the filter.

    Levenberg-Marquardt's damping reads the step's curvature (scaled by ``ρ²``).
    """
    case, plain = twins

    def settings() -> dict:  # Levenberg-Marquardt adapts: one policy per optimizer
        rule = DAMPING if damping == "constant" else LevenbergMarquardt(0.1, interval=1)
        return {"damping": rule, "averaging": CurvatureAveraging(interval=2)}

    filtered = DampedNewton(
        case.model.parameters(),
        basis=KroneckerBasis(noise_filter=NoiseFilter(floor=1.0)),
        seed=0,
        **settings(),
    )
    unfiltered = DampedNewton(plain.model.parameters(), seed=0, **settings())
    train_twins([(filtered, case), (unfiltered, plain)], steps=4)
    assert_same_parameters(case.model, plain.model, rtol=1e-12, atol=1e-14)


def _filtered_every_second_step(case: Case) -> DampedNewton:
    """The filter with refreshes at steps 0, 2, 4, ..."""
    return DampedNewton(
        case.model.parameters(),
        basis=KroneckerBasis(noise_filter=FILTER),
        averaging=CurvatureAveraging(interval=2, ramp=False),
        seed=0,
    )


def test_moments_start_anew_after_steps_without_the_filter():
    """Switched off across a refresh and on again: stale moments are not rotated."""
    case = build_case(case_by_id("mlp-ce"))
    optimizer = _filtered_every_second_step(case)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    (group,) = optimizer.param_groups
    weight = case.model[0].weight
    for basis in (group["basis"], KroneckerBasis(), KroneckerBasis()):
        group["basis"] = basis
        optimizer.step(closure)  # step 0 filtered; 1 and 2 (a refresh) plain
    assert optimizer.state[weight]["noise_filter_first_weight"] == pytest.approx(
        1 - FILTER.beta1**1, rel=1e-14
    )
    optimizer.step(closure)  # step 3, plain
    group["basis"] = KroneckerBasis(noise_filter=FILTER)
    optimizer.step(closure)  # step 4 refreshes: the filter starts again
    assert optimizer.state[weight]["noise_filter_first_weight"] == pytest.approx(
        1 - FILTER.beta1, rel=1e-14
    )
    optimizer.step(closure)
    assert optimizer.state[weight]["noise_filter_first_weight"] == pytest.approx(
        1 - FILTER.beta1**2, rel=1e-14
    )


def test_noise_filter_settings_say_what_to_do():
    for name in ("beta1", "beta2"):
        with pytest.raises(ValueError, match=f"0 <= {name} < 1"):
            NoiseFilter(**{name: 1.0})
        with pytest.raises(TypeError, match=f"0 <= {name} < 1"):
            NoiseFilter(**{name: "0.9"})
    with pytest.raises(ValueError, match="0 <= floor <= 1"):
        NoiseFilter(floor=-0.1)
    with pytest.raises(TypeError, match=r"noise_filter=NoiseFilter\(\.\.\.\) or None"):
        KroneckerBasis(noise_filter=0.9)
    basis = KroneckerBasis(noise_filter=NoiseFilter(0.9, 0.99, 0.2))
    assert pickle.loads(pickle.dumps(basis)) == basis
    assert isinstance(GramBasis(), GramBasis)  # the Gram basis has no filter field


@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_moments_start_anew_when_a_bias_is_frozen_or_unfrozen(change):
    """The layer's factors change shape at the next refresh: so do its moments."""
    case = build_case(case_by_id("mlp-ce"))
    first = case.model[0]
    first.bias.requires_grad_(change == "freeze")
    optimizer = _filtered_every_second_step(case)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    for _ in range(3):  # refreshes at steps 0 and 2
        optimizer.step(closure)
    first.bias.requires_grad_(change == "unfreeze")
    optimizer.step(closure)  # step 3, between refreshes
    optimizer.step(closure)  # step 4 refreshes: the moments start again
    assert optimizer.state[first.weight]["noise_filter_first_weight"] == pytest.approx(
        1 - FILTER.beta1, rel=1e-14
    )
    optimizer.step(closure)


def test_an_unused_layer_keeps_its_moments_as_adam_its_state():
    """A step that leaves the first layer unused advances none of its moments.

    Its ``.grad`` stays None: not between refreshes (step 2), not at a refresh
    (step 3).
    """
    case = build_case(case_by_id("mlp-ce"))
    optimizer = DampedNewton(
        case.model.parameters(), seed=0, basis=KroneckerBasis(noise_filter=FILTER)
    )
    first, *rest = case.model
    for step in range(5):
        unused = step in (2, 3)
        before = {
            key: value.clone() for key, value in optimizer.state[first.weight].items()
        }

        def closure(unused: bool = unused) -> Tensor:
            optimizer.zero_grad()
            hidden = first(case.X)
            loss = case.loss_fn(
                torch.nn.Sequential(*rest)(hidden.detach() if unused else hidden),
                case.y,
            )
            loss.backward()
            return loss

        optimizer.step(closure)
        moments = [key for key in before if key.startswith("noise_filter")]
        if unused:
            assert moments and all(
                torch.equal(optimizer.state[first.weight][key], before[key])
                for key in moments
            )
        elif moments:
            assert not torch.equal(
                optimizer.state[first.weight][moments[0]], before[moments[0]]
            )
