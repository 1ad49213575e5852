"""The Kronecker basis' steps against K-FAC of brute-force exact-GGN factors (float64).

References come from the plain twin of each problem (:mod:`tests.reference.kronecker`):
the layers' factors from autograd Jacobians and hooked inputs, the step from dense
solves with K-FAC's factored Tikhonov damping.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import Tensor, nn

from dampednewton import (
    CurvatureAveraging,
    DampedNewton,
    GramBasis,
    KroneckerBasis,
    LevenbergMarquardt,
    NoiseAwareDamping,
)
from dampednewton._step.kronecker_state import INPUT_FACTOR, OUTPUT_FACTOR
from tests.assertions import assert_close
from tests.cases import KRONECKER_PROBLEMS, case_by_id
from tests.reference.ggn import ggn
from tests.reference.kronecker import kfac_direction, kfac_model, kronecker_factors
from tests.utils import (
    Case,
    assert_parameters_equal,
    assert_same_state,
    build_case,
    make_closure,
    snapshot,
)

LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d)
FULL_RANK = KroneckerBasis(exact_size=1000)
"""Every factor of the test problems decomposed exactly."""
EXACT = {
    "mc_samples": 0,
    "basis": FULL_RANK,
    "kl_clip": None,
    "momentum": 0.0,
    "weight_decay": 0.0,
}


def layers_of(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, LAYERS)]


def gradient_matrix(layer: nn.Module, bias: bool = True) -> Tensor:
    parts = [layer.weight.grad.reshape(layer.weight.shape[0], -1)]
    if bias and layer.bias is not None:
        parts.append(layer.bias.grad[:, None])
    return torch.cat(parts, dim=1)


def reference_gradients(case: Case) -> None:
    """Fill the reference model's ``.grad`` with the mean loss's gradient."""
    case.reference_model.zero_grad()
    case.reference_loss_fn(case.reference_model(case.X), case.y).backward()


def reference_factors(case: Case) -> list[tuple[Tensor, Tensor]]:
    return [
        kronecker_factors(
            case.reference_model, case.reference_loss_fn, layer, case.X, case.y
        )
        for layer in layers_of(case.reference_model)
    ]


def apply_reference(case: Case, factors, damping: float, scale: float = 1.0) -> None:
    """Move the reference model by ``scale`` times K-FAC's step from ``factors``."""
    reference_gradients(case)
    with torch.no_grad():
        for layer, (inputs, outputs) in zip(
            layers_of(case.reference_model), factors, strict=True
        ):
            step = kfac_direction(inputs, outputs, gradient_matrix(layer), damping)
            width = layer.weight[0].numel()
            layer.weight += scale * step[:, :width].reshape(layer.weight.shape)
            layer.bias += scale * step[:, width]


def assert_models_close(case: Case, rtol: float = 1e-9) -> None:
    for index, (actual, expected) in enumerate(
        zip(case.model.parameters(), case.reference_model.parameters(), strict=True)
    ):
        assert_close(actual, expected, rtol=rtol, atol=1e-11, name=f"param {index}")


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
    assert optimizer.state["groups"][0]["curvature_updates"] == 2


def test_refreshes_between_rotations_keep_the_eigenvectors():
    """Refreshes 0-5 decompose; 6 and 7 take Rayleigh quotients (interval 3)."""
    case = build_case(case_by_id("cnn1d-ce"))
    averaging = CurvatureAveraging(decay=0.5, interval=1, ramp=False)
    optimizer = DampedNewton(
        case.model.parameters(),
        basis=KroneckerBasis(rank=1000, rotation_interval=3),
        averaging=averaging,
        mc_samples=0,
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    weight = layers_of(case.model)[0].weight
    vectors = []
    for step in range(8):
        optimizer.step(closure)
        state = optimizer.state[weight]
        vectors.append(state["kronecker_input_vectors"].clone())
        corrected = state[INPUT_FACTOR] / (1 - 0.5 ** (step + 1))
        values = state["kronecker_input_values"]
        basis = state["kronecker_input_vectors"]
        if step in (6, 7):
            assert torch.equal(vectors[step], vectors[step - 1])
            quotients = torch.einsum("dr,de,er->r", basis, corrected, basis)
            assert_close(values, quotients.clamp_min(0), rtol=1e-10, atol=1e-14)
        else:
            assert step == 0 or not torch.equal(vectors[step], vectors[step - 1])
            assert_close((basis * values) @ basis.T, corrected, rtol=1e-8, atol=1e-12)
    assert [KroneckerBasis().rotates(r) for r in range(10)] == [
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
    assert optimizer.state["groups"][0]["trust_region_scale"] == pytest.approx(
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
    assert optimizer.state["global"]["reduction_ratio"] == pytest.approx(
        ratio, rel=1e-8
    )


def test_state_dict_resumes_between_refreshes_bitwise():
    runs = [build_case(case_by_id("cnn-wide-ce")) for _ in range(2)]
    averaging = CurvatureAveraging(decay=0.9, interval=4, ramp=False)

    def optimizer_of(case: Case) -> DampedNewton:
        return DampedNewton(
            case.model.parameters(), averaging=averaging, momentum=0.5, seed=3
        )

    first = optimizer_of(runs[0])
    closure = make_closure(first, runs[0].model, runs[0].loss_fn, runs[0].X, runs[0].y)
    for _ in range(2):
        first.step(closure)
    saved = copy.deepcopy(first.state_dict())
    with torch.no_grad():
        for target, source in zip(
            runs[1].model.parameters(), runs[0].model.parameters(), strict=True
        ):
            target.copy_(source)
    second = optimizer_of(runs[1])
    second.load_state_dict(saved)
    other = make_closure(second, runs[1].model, runs[1].loss_fn, runs[1].X, runs[1].y)
    for _ in range(5):  # across the refresh at step 4
        first.step(closure)
        second.step(other)
    assert_parameters_equal(
        list(runs[1].model.parameters()), list(runs[0].model.parameters())
    )
    assert_same_state(snapshot(second), snapshot(first))


@pytest.mark.parametrize("refresh", [True, False], ids=["refresh", "between"])
def test_a_non_finite_batch_leaves_no_trace(refresh):
    case = build_case(case_by_id("mlp-ce"))
    averaging = CurvatureAveraging(interval=2, ramp=False)
    optimizer = DampedNewton(
        case.model.parameters(), averaging=averaging, nonfinite="skip", seed=0
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    optimizer.step(closure)  # step 0 refreshes, step 1 does not, step 2 does
    if refresh:
        optimizer.step(closure)
    before = snapshot(optimizer)
    params = [p.detach().clone() for p in case.model.parameters()]
    bad = case.X.clone()
    bad[0, 0] = math.nan
    with pytest.warns(RuntimeWarning, match="refused"):
        optimizer.step(make_closure(optimizer, case.model, case.loss_fn, bad, case.y))
    assert_parameters_equal(list(case.model.parameters()), params)
    before["state"]["global"]["skipped_steps"] += 1  # counted, nothing else
    assert_same_state(snapshot(optimizer), before)


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
    with pytest.raises(TypeError, match="rank >= 1"):
        KroneckerBasis(rank=2.5)
    with pytest.raises(ValueError, match="exact_size >= 0"):
        KroneckerBasis(exact_size=-1)
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
