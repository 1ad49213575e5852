"""The Kronecker basis' steps against K-FAC of brute-force exact-GGN factors (float64).

References come from the plain twin of each problem (:mod:`tests.reference.kronecker`):
the layers' factors from autograd Jacobians and hooked inputs, the step from dense
solves with K-FAC's factored Tikhonov damping.
"""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.micro.step_profile import EigensolverCalls
from dampednewton import (
    CurvatureAveraging,
    DampedNewton,
    KroneckerBasis,
    LevenbergMarquardt,
)
from dampednewton._step.kronecker_state import INPUT_FACTOR, OUTPUT_FACTOR
from tests.assertions import assert_close
from tests.cases import KRONECKER_PROBLEMS, case_by_id
from tests.optimizer.kronecker_twin import (
    EXACT,
    apply_reference,
    assert_models_close,
    gradient_matrix,
    layers_of,
    reference_factors,
    reference_gradients,
)
from tests.reference.kronecker import (
    kfac_direction,
    kfac_model,
    kronecker_factors,
    power_rotation,
)
from tests.utils import (
    Case,
    build_case,
    copy_parameters,
    make_closure,
)


@pytest.fixture(params=KRONECKER_PROBLEMS, ids=lambda problem: problem.id)
def case(request) -> Case:
    return build_case(request.param)


@pytest.mark.parametrize("damping", [1e-3, 0.3])
def test_first_step_is_kfac_of_the_exact_ggn(case, damping):
    optimizer = DampedNewton(
        case.model.parameters(), damping=damping, averaging=None, **EXACT
    )
    factors = reference_factors(case)
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    apply_reference(case, factors, damping)
    assert_models_close(case)
    for layer, (inputs, outputs) in zip(layers_of(case.model), factors, strict=True):
        state = optimizer.state[layer.weight]
        assert_close(state[INPUT_FACTOR], inputs, rtol=1e-10, atol=1e-12, name="A")
        assert_close(state[OUTPUT_FACTOR], outputs, rtol=1e-10, atol=1e-12, name="S")


def test_factors_from_a_subsample_are_its_own_means():
    case = build_case(case_by_id("cnn-ce"))
    optimizer = DampedNewton(
        case.model.parameters(), averaging=None, subsampling_ggn=[0, 2], **EXACT
    )
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    for layer, reference_layer in zip(
        layers_of(case.model), layers_of(case.reference_model), strict=True
    ):
        inputs, outputs = kronecker_factors(
            case.reference_model,
            case.reference_loss_fn,
            reference_layer,
            case.X,
            case.y,
            samples=[0, 2],
        )
        state = optimizer.state[layer.weight]
        assert_close(state[INPUT_FACTOR], inputs, rtol=1e-10, atol=1e-12, name="A")
        assert_close(state[OUTPUT_FACTOR], outputs, rtol=1e-10, atol=1e-12, name="S")


def test_averages_and_steps_between_refreshes():
    """Refresh at steps 0 and 3; steps 1 and 2 reuse step 0's factors."""
    case = build_case(case_by_id("mlp-ce"))
    decay, damping = 0.5, 0.01
    averaging = CurvatureAveraging(
        decay=decay, interval=3, ramp=False, loss_tolerance=None
    )
    optimizer = DampedNewton(
        case.model.parameters(), damping=damping, averaging=averaging, **EXACT
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    first = reference_factors(case)
    for _ in range(3):
        optimizer.step(closure)
        apply_reference(case, first, damping)
        assert_models_close(case)
    fresh = reference_factors(case)
    averaged = [
        tuple(
            (decay * (1 - decay) * old + (1 - decay) * new) / (1 - decay**2)
            for old, new in zip(before, now, strict=True)
        )
        for before, now in zip(first, fresh, strict=True)
    ]
    optimizer.step(closure)
    apply_reference(case, averaged, damping)
    assert_models_close(case)
    assert optimizer.records["groups"][0]["curvature_updates"] == 2


@pytest.mark.parametrize("solved", [None, 5], ids=["every-rotation-solves", "default"])
def test_refreshes_between_rotations_keep_the_eigenvectors(solved):
    """Refreshes 0-5 and 8 rotate, 6 and 7 take Rayleigh quotients (interval 3).

    Rotations that solve reproduce the averaged factor; the default's after the
    first five (5 and 8) take one subspace iteration from the stored eigenvectors,
    orthonormalized (the Gram-Schmidt reference), with their Rayleigh quotients.
    """
    case = build_case(case_by_id("cnn1d-ce"))
    averaging = CurvatureAveraging(decay=0.5, interval=1, ramp=False)
    optimizer = DampedNewton(
        case.model.parameters(),
        basis=KroneckerBasis(rank=1000, rotation_interval=3, solved_rotations=solved),
        averaging=averaging,
        mc_samples=0,
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    weight = layers_of(case.model)[0].weight
    vectors, values = [], []
    for step in range(9):
        with EigensolverCalls() as solves:
            optimizer.step(closure)
        state = optimizer.state[weight]
        vectors.append(state["kronecker_input_vectors"].clone())
        values.append(state["kronecker_input_values"].clone())
        corrected = state[INPUT_FACTOR] / (1 - 0.5 ** (step + 1))
        basis = vectors[step]
        quotients = torch.einsum("dr,de,er->r", basis, corrected, basis).clamp_min(0)
        if step in (6, 7):
            assert torch.equal(vectors[step], vectors[step - 1])
            assert_close(values[step], quotients, rtol=1e-10, atol=1e-14)
        elif step in (5, 8) and solved is not None:
            assert solves.count == 0
            expected = power_rotation(corrected, values[step - 1], vectors[step - 1])
            signs = torch.sign((expected * basis).sum(0))
            assert_close(basis, expected * signs, rtol=1e-8, atol=1e-12, name="vectors")
            assert_close(values[step], quotients, rtol=1e-10, atol=1e-14)
        else:
            assert solves.count > 0
            assert step == 0 or not torch.equal(vectors[step], vectors[step - 1])
            assert_close(
                (basis * values[step]) @ basis.T, corrected, rtol=1e-8, atol=1e-12
            )
    assert all(KroneckerBasis().rotates(r) for r in range(10))  # every refresh
    assert [KroneckerBasis(rotation_interval=3).rotates(r) for r in range(10)] == [
        True,
        True,
        True,
        True,
        True,
        True,
        False,
        False,
        True,
        False,
    ]


@pytest.mark.parametrize("lr", [0.5, 2.0])
def test_trust_region_scales_the_step(lr):
    case = build_case(case_by_id("cnn1d-ce"))
    damping, kl_clip = 0.01, 1e-3
    settings = {**EXACT, "kl_clip": kl_clip}
    optimizer = DampedNewton(
        case.model.parameters(), lr=lr, damping=damping, averaging=None, **settings
    )
    factors = reference_factors(case)
    reference_gradients(case)
    slope = sum(
        kfac_model(
            inputs,
            outputs,
            gradient_matrix(layer),
            kfac_direction(inputs, outputs, gradient_matrix(layer), damping),
        )[0]
        for layer, (inputs, outputs) in zip(
            layers_of(case.reference_model), factors, strict=True
        )
    )
    scale = min(1.0, math.sqrt(2 * kl_clip / -float(slope)))
    assert scale < 1  # the bound is active
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    apply_reference(case, factors, damping, scale=lr * scale)
    assert_models_close(case)
    assert optimizer.records["groups"][0]["trust_region_scale"] == pytest.approx(
        scale, rel=1e-10
    )


@pytest.mark.parametrize(
    ("momentum", "nesterov"),
    [(0.9, False), (0.9, True), (0.0, False)],
    ids=["heavy-ball", "nesterov", "no-momentum"],
)
def test_momentum_and_weight_decay_follow_the_update_rule(
    momentum: float, nesterov: bool
):
    """``m ← μm + s``, ``θ ← (1 − lr·wd)θ + lr·m`` (Nesterov: ``lr·(s + μm)``).

    The first step creates the buffers parameter by parameter, the later ones take
    the multi-tensor kernels.
    """
    case = build_case(case_by_id("mlp-mse"))
    damping, lr, decay = 0.1, 0.5, 0.01
    optimizer = DampedNewton(
        case.model.parameters(),
        lr=lr,
        damping=damping,
        averaging=None,
        nesterov=nesterov,
        **{**EXACT, "momentum": momentum, "weight_decay": decay},
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    buffers = None
    for _ in range(3):
        factors = reference_factors(case)
        reference_gradients(case)
        steps = []
        for layer, (inputs, outputs) in zip(
            layers_of(case.reference_model), factors, strict=True
        ):
            step = kfac_direction(inputs, outputs, gradient_matrix(layer), damping)
            width = layer.weight[0].numel()
            steps += [step[:, :width].reshape(layer.weight.shape), step[:, width]]
        buffers = (
            steps
            if buffers is None
            else [momentum * b + s for b, s in zip(buffers, steps, strict=True)]
        )
        updates = (
            [s + momentum * b for s, b in zip(steps, buffers, strict=True)]
            if nesterov
            else buffers
        )
        optimizer.step(closure)
        with torch.no_grad():
            for param, update in zip(
                case.reference_model.parameters(), updates, strict=True
            ):
                param.mul_(1 - lr * decay).add_(update, alpha=lr)
        assert_models_close(case)


def test_levenberg_marquardt_reads_the_kronecker_model():
    case = build_case(case_by_id("mlp-ce"))
    damping = LevenbergMarquardt(0.1, interval=1)
    optimizer = DampedNewton(
        case.model.parameters(), damping=damping, averaging=None, **EXACT
    )
    factors = reference_factors(case)
    reference_gradients(case)
    slope = curvature = 0.0
    for layer, (inputs, outputs) in zip(
        layers_of(case.reference_model), factors, strict=True
    ):
        gradient = gradient_matrix(layer)
        step = kfac_direction(inputs, outputs, gradient, 0.1)
        layer_slope, layer_curvature = kfac_model(inputs, outputs, gradient, step)
        slope, curvature = slope + layer_slope, curvature + layer_curvature
    before = case.reference_loss_fn(case.reference_model(case.X), case.y).item()
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    apply_reference(case, factors, 0.1)
    after = case.reference_loss_fn(case.reference_model(case.X), case.y).item()
    ratio = (after - before) / float(slope + curvature / 2)
    assert optimizer.records["global"]["reduction_ratio"] == pytest.approx(
        ratio, rel=1e-8
    )


@pytest.mark.parametrize("change", ["freeze", "unfreeze"])
def test_a_bias_frozen_or_unfrozen_restarts_its_layer_average(change):
    """The factors change shape (the bias's 1 in the inputs): the average restarts.

    Refreshes at steps 0, 1, 3 (the ramp): the last layer's bias changes at step 2,
    so the refresh at step 3 stores this batch's factors for that layer, bias
    corrected as a first refresh would (the exact GGN, the float64 reference).
    """
    case = build_case(case_by_id("mlp-ce"))
    last = layers_of(case.model)[-1]
    if change == "unfreeze":
        last.bias.requires_grad_(False)
    decay = 0.9
    optimizer = DampedNewton(
        case.model.parameters(), averaging=CurvatureAveraging(decay=decay), **EXACT
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    for _ in range(2):
        optimizer.step(closure)
    last.bias.requires_grad_(change == "unfreeze")
    bias = last.bias.detach().clone()
    optimizer.step(closure)  # between refreshes
    copy_parameters(case.reference_model, case.model)  # where the refresh starts
    optimizer.step(closure)
    if change == "freeze":
        assert torch.equal(last.bias, bias)
    inputs, outputs = kronecker_factors(
        case.reference_model,
        case.reference_loss_fn,
        layers_of(case.reference_model)[-1],
        case.X,
        case.y,
        bias=change == "unfreeze",
    )
    correction = 1 - decay  # the layer's first refresh, the group's third
    assert optimizer.records["groups"][0]["kronecker_layer_refreshes"][-1] == 1
    state = optimizer.state[last.weight]
    assert_close(state[INPUT_FACTOR] / correction, inputs, rtol=1e-10, atol=1e-12)
    assert_close(state[OUTPUT_FACTOR] / correction, outputs, rtol=1e-10, atol=1e-12)


def test_a_rotation_after_the_rank_changed_solves_afresh():
    """Stored eigenvectors of another rank cannot be rotated: they are solved anew."""
    case = build_case(case_by_id("mlp-ce"))
    averaging = CurvatureAveraging(decay=0.5, interval=1, ramp=False)
    optimizer = DampedNewton(
        case.model.parameters(),
        basis=KroneckerBasis(rank=2, exact_size=0, rotation_interval=1),
        averaging=averaging,
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    weight = layers_of(case.model)[0].weight
    for step in range(7):  # refreshes 5 and 6 rotate without an eigensolver
        with EigensolverCalls() as solves:
            optimizer.step(closure)
        assert (solves.count > 0) == (step < 5)
    optimizer.param_groups[0]["basis"] = KroneckerBasis(
        rank=3, exact_size=0, rotation_interval=1
    )
    with EigensolverCalls() as solves:
        optimizer.step(closure)
    assert solves.count > 0
    assert optimizer.state[weight]["kronecker_input_vectors"].shape[-1] == 3
