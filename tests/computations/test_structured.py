"""The structured (Kronecker) path agrees with the materialized one everywhere."""

from __future__ import annotations

import pytest
import torch
from backpack import backpack, extend
from torch import nn

from dampednewton import (
    DirectionalDampedNewtonComputation,
    DirectionalDerivativesComputation,
    EigenvalueThreshold,
    EighComputation,
    EigvalshComputation,
    TopK,
)
from tests.assertions import assert_close
from tests.case_models import initialize
from tests.cases import PROBLEMS
from tests.utils import make_groups


def _sequence_model() -> nn.Module:
    """A linear layer with weight sharing over positions (materialized weight)."""
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Flatten(), nn.Linear(12, 3))


def _conv1d_model() -> nn.Module:
    """Conv1d with 2 output positions: the contraction over positions is cheaper."""
    return nn.Sequential(nn.Conv1d(6, 5, 3), nn.Tanh(), nn.Flatten(), nn.Linear(10, 3))


def _conv3d_model() -> nn.Module:
    """Conv3d with 4 output positions: the contraction over positions is cheaper."""
    return nn.Sequential(nn.Conv3d(6, 6, 2), nn.ReLU(), nn.Flatten(), nn.Linear(24, 3))


def _grouped_conv_model() -> nn.Module:
    """Grouped convolution: materialized weight, structured bias."""
    return nn.Sequential(
        nn.Conv2d(6, 6, 3, groups=2), nn.ReLU(), nn.Flatten(), nn.Linear(24, 3)
    )


# Cases beyond PROBLEMS: (model factory, input shape), with 4 samples and 3 classes.
LOCAL_CASES = {
    "sequence-linear": (_sequence_model, (4, 3, 5)),
    "conv1d": (_conv1d_model, (4, 6, 4)),
    "conv3d": (_conv3d_model, (4, 6, 3, 3, 2)),
    "grouped-conv": (_grouped_conv_model, (4, 6, 4, 4)),
}


def build(problem_id: str):
    if problem_id in LOCAL_CASES:
        factory, input_shape = LOCAL_CASES[problem_id]
        generator = torch.Generator().manual_seed(11)
        with torch.device("meta"):
            model = factory()
        model = initialize(model, generator)
        X = torch.randn(*input_shape, generator=generator, dtype=torch.float64)
        return model, nn.CrossEntropyLoss(), X, torch.tensor([0, 1, 2, 1])
    problem = next(p for p in PROBLEMS if p.id == problem_id)
    return problem.build()


CASES = [p.id for p in PROBLEMS] + list(LOCAL_CASES)
COMPUTATIONS = {
    "eigvalsh": lambda **kw: EigvalshComputation(
        subsampling=kw["subsampling_ggn"], structured=kw["structured"]
    ),
    "eigh": lambda **kw: EighComputation(
        subsampling=kw["subsampling_ggn"], structured=kw["structured"]
    ),
    "directional": lambda **kw: DirectionalDerivativesComputation(**kw),
    "newton": lambda **kw: DirectionalDampedNewtonComputation(**kw),
}


def results(computation_name, problem_id, structure, subsampling, structured):
    model, loss_fn, X, y = build(problem_id)
    model, loss_fn = extend(model), extend(loss_fn)
    groups = make_groups(
        model, structure, criterion=EigenvalueThreshold(1e-7), damping=0.3
    )
    computation = COMPUTATIONS[computation_name](
        subsampling_ggn=subsampling,
        subsampling_grad=subsampling and subsampling[::-1],
        structured=structured,
    )
    hook = computation.get_extension_hook(groups)
    with backpack(*computation.get_extensions(), extension_hook=hook):
        loss_fn(model(X), y).backward()
    return [computation.get_result(group) for group in groups]


def invariants(computation_name, result) -> list[torch.Tensor]:
    """Quantities independent of the eigenvector basis within repeated eigenvalues.

    Eigenvectors are defined up to sign, and up to rotation within a repeated
    eigenvalue (the last layer's block under MSE has C-fold eigenvalues). With all
    non-zero directions selected, these quantities are unique: eigenvalues, the
    projector ``E Eᵀ``, ``γ γᵀ = g E Eᵀ gᵀ``, ``Σ_k λ_nk`` and the step.
    """
    if computation_name == "eigvalsh":
        return [result]
    if computation_name == "eigh":
        evals, evecs = result
        E = torch.cat([v.flatten(start_dim=1) for v in evecs], 1).T
        return [evals, E @ E.T]
    if computation_name == "directional":
        gammas, lambdas = result
        return [gammas @ gammas.T, lambdas.sum(1), lambdas.mean(0)]
    return [torch.cat([s.flatten() for s in result])]


@pytest.mark.parametrize("subsampling", [None, [3, 0]], ids=["all", "subsampled"])
@pytest.mark.parametrize("structure", ["full", "per-layer"])
@pytest.mark.parametrize("problem_id", CASES)
@pytest.mark.parametrize("computation_name", list(COMPUTATIONS))
def test_structured_equals_materialized(
    computation_name, problem_id, structure, subsampling
):
    args = (computation_name, problem_id, structure, subsampling)
    fast, dense = results(*args, structured=True), results(*args, structured=False)
    for group_fast, group_dense in zip(fast, dense, strict=True):
        for a, b in zip(
            invariants(computation_name, group_fast),
            invariants(computation_name, group_dense),
            strict=True,
        ):
            assert_close(a, b, rtol=1e-8, atol=1e-12, name=computation_name)


def _newton_pass(problem_id, structure, **settings):
    model, loss_fn, X, y = build(problem_id)
    model, loss_fn = extend(model), extend(loss_fn)
    groups = make_groups(model, structure, criterion=TopK(3), damping=0.3)
    computation = DirectionalDampedNewtonComputation(**settings)
    hook = computation.get_extension_hook(groups)
    with backpack(*computation.get_extensions(), extension_hook=hook):
        loss_fn(model(X), y).backward()
    return computation, groups


@pytest.mark.parametrize("mc_samples", [0, 1], ids=["exact", "mc1"])
@pytest.mark.parametrize("subsampling", [None, [0, 2]], ids=["all", "subsampled"])
@pytest.mark.parametrize("structured", [True, False], ids=["structured", "dense"])
@pytest.mark.parametrize("structure", ["full", "per-layer"])
@pytest.mark.parametrize("problem_id", CASES)
def test_mean_gradient_mode_equals_per_sample_mode(
    problem_id, structure, structured, subsampling, mc_samples
):
    """``γ̄ = ḡᵀ e_k`` without per-sample gradients gives the per-sample route's step.

    Under MC-1 the first layers' products come from output gradients and the input
    kernel (cheaper than from ``.grad``); the draws are the same in both modes.
    """
    steps = []
    for per_sample_gradients in (True, False):
        computation, groups = _newton_pass(
            problem_id,
            structure,
            subsampling_ggn=subsampling,
            mc_samples_ggn=mc_samples,
            generator=torch.Generator().manual_seed(5),
            structured=structured,
            per_sample_gradients=per_sample_gradients,
        )
        steps.append(invariants("newton", computation.get_result(groups[0])))
        details = computation.get_details(groups[0])
        assert details.gamma_mean.shape == details.evals.shape
    assert_close(steps[1][0], steps[0][0], rtol=1e-9, atol=1e-12, name="mean mode")


def test_mc1_mean_mode_takes_the_kernel_route_on_wide_inputs():
    """MLP 5-4-3 at N=4 under MC-1: ``N·C = 4 < d_in = 5`` for the first layer."""
    computation, groups = _newton_pass(
        "mlp-ce",
        "full",
        mc_samples_ggn=1,
        generator=torch.Generator().manual_seed(0),
        per_sample_gradients=False,
    )
    (block,) = computation._engine._ready.values()
    first_weight = groups[0]["params"][0]
    assert block.factors[id(first_weight)].output_gradients is not None
    computation.get_result(groups[0])


def test_mean_gradient_mode_refuses_gradient_subsampling():
    with pytest.raises(ValueError, match="subsampling_grad"):
        DirectionalDampedNewtonComputation(
            subsampling_grad=[0], per_sample_gradients=False
        )
