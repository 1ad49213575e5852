"""Shared test helpers: built problems, groups, closures, passes and state checks.

Test modules import their helpers from here (brute-force quantities come from
:mod:`tests.reference`, tensor comparisons from :mod:`tests.assertions`, problems
from :mod:`tests.cases`); no test module imports from another.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from backpack import backpack, extend
from backpack.extensions import BatchGrad
from torch import Tensor, nn
from torch.func import functional_call

from dampednewton import DampedNewton, GramBasis
from dampednewton.backpack.extensions import ExactSqrtGGN
from dampednewton.diagnostics import DiagnosticsMonitor
from tests import reference
from tests.assertions import assert_close, assert_close_up_to_sign
from tests.case_models import initialize
from tests.cases import Problem


@dataclass
class Case:
    """A problem built twice: BackPACK-extended, and plain for the references.

    Attributes:
        model: Extended model.
        loss_fn: Extended loss function.
        reference_model: Plain copy with equal parameters.
        reference_loss_fn: Plain loss function.
        X: Inputs.
        y: Targets.
    """

    model: nn.Module
    loss_fn: nn.Module
    reference_model: nn.Module
    reference_loss_fn: nn.Module
    X: Tensor
    y: Tensor

    def reference_params(self, params: list[Tensor]) -> list[Tensor]:
        """Return the reference model's parameters matching ``params``."""
        index = {id(p): i for i, p in enumerate(self.model.parameters())}
        reference = list(self.reference_model.parameters())
        return [reference[index[id(p)]] for p in params]


def build_case(
    problem: Problem, dtype: torch.dtype = torch.float64, device: str = "cpu"
) -> Case:
    """Build a problem for BackPACK and for the brute-force references."""
    model, loss_fn, X, y = problem.build(dtype, device)
    reference_model, reference_loss_fn, _, _ = problem.build(dtype, device)
    return Case(
        extend(model), extend(loss_fn), reference_model, reference_loss_fn, X, y
    )


def make_groups(model: nn.Module, structure: str, **keys) -> list[dict]:
    """Parameter groups for a block structure, each with the given extra keys."""
    params = list(model.parameters())
    if structure == "full":
        return [{"params": params, **keys}]
    return [{"params": [p], **keys} for p in params]


VIVIT_STEP = {
    "basis": GramBasis(),
    "complement": None,
    "newton_fraction": 1.0,
    "averaging": None,
    "kl_clip": None,
}
"""ViViT's step from this batch's GGN, unclipped and whole: the Gram basis' defaults
switch on the complement, curvature averaging, a trust region and take a fraction of
the Newton step (and the package's default basis is the Kronecker one)."""
EXACT_VIVIT_STEP = {**VIVIT_STEP, "mc_samples": 0}
"""ViViT's step from this batch's exact GGN (the default is Monte-Carlo)."""

NOISE_LEVEL = 1e-10
"""Reference GGN eigenvalues below ``NOISE_LEVEL · λ_max`` are numerically zero."""


def make_closure(
    optimizer: DampedNewton,
    model: Callable[[Tensor], Tensor],
    loss_fn: nn.Module,
    X: Tensor,
    y: Tensor,
) -> Callable[[], Tensor]:
    """The closure pattern of ``DampedNewton.step``: zero_grad, forward, backward."""

    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = loss_fn(model(X), y)
        loss.backward()
        return loss

    return closure


def default_losses(
    model: nn.Module, loss_fn: nn.Module, X: Tensor, y: Tensor, steps: int
) -> tuple[float, float]:
    """The first and the last loss of ``steps`` steps of the defaults on one batch.

    Extends ``model`` and ``loss_fn`` (in place).
    """
    model, loss_fn = extend(model), extend(loss_fn)
    optimizer = DampedNewton(model.parameters())
    closure = make_closure(optimizer, model, loss_fn, X, y)
    first = last = optimizer.step(closure).item()
    for _ in range(steps - 1):
        last = optimizer.step(closure).item()
    return first, last


def run_steps(optimizer: DampedNewton, case: Case, steps: int) -> None:
    """Take ``steps`` steps of the optimizer on the case's fixed batch."""
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    for _ in range(steps):
        optimizer.step(closure)


def train_twins(runs: Sequence[tuple[DampedNewton, Case]], steps: int) -> None:
    """Take ``steps`` steps of each optimizer on its case's fixed batch."""
    for optimizer, case in runs:
        run_steps(optimizer, case, steps)


def assert_same_parameters(
    first: nn.Module, second: nn.Module, rtol: float, atol: float
) -> None:
    """Two models' parameters agree, pair by pair."""
    for actual, expected in zip(first.parameters(), second.parameters(), strict=True):
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


def layer_groups(model: nn.Module) -> list[list[nn.Parameter]]:
    """One group per layer with parameters; a lone layer is split into its tensors."""
    layers = [
        list(module.parameters(recurse=False))
        for module in model.modules()
        if next(module.parameters(recurse=False), None) is not None
    ]
    if len(layers) == 1:
        return [[param] for param in layers[0]]
    return layers


def flat(tensors: Sequence[Tensor]) -> Tensor:
    """Concatenate flattened tensors into a detached float64 vector."""
    return torch.cat([t.detach().flatten() for t in tensors]).to(torch.float64)


def copy_parameters(target: nn.Module, source: nn.Module) -> None:
    """Copy the parameter values of ``source`` into ``target`` (cast to its dtype)."""
    with torch.no_grad():
        for to, origin in zip(target.parameters(), source.parameters(), strict=True):
            to.copy_(origin)


@dataclass
class ReferenceStep:
    """Brute-force float64 damped Newton step of one group and its ingredients.

    Attributes:
        step: Step ``s = Σ_k −γ̄_k/(λ̄_k + δ_k) e_k`` (and the complement term)
            over the group, ``[D]``.
        evals: Selected GGN eigenvalues, ascending, ``[K]``.
        gamma_mean: Mean directional gradients (sign of ``eigh``'s eigenvectors).
        lambda_mean: Mean directional curvatures.
        damping: Damping per direction.
        spectrum: All GGN eigenvalues of the block, numerically zero ones set to 0.
        complement_curvature: ``ρ`` of the complement step, if any.
    """

    step: Tensor
    evals: Tensor
    gamma_mean: Tensor
    lambda_mean: Tensor
    damping: Tensor
    spectrum: Tensor
    complement_curvature: float | None = None


def reference_step(
    model: nn.Module,
    loss_fn: nn.Module,
    params: Sequence[Tensor],
    X: Tensor,
    y: Tensor,
    criterion: Any,
    damping: Any,
    complement: Any = None,
    newton_fraction: float = 1.0,
) -> ReferenceStep:
    """Damped Newton step of a group from the explicit float64 GGN.

    The criterion (``int k`` or a callable on ascending eigenvalues) is applied to
    the GGN spectrum with numerically zero eigenvalues set to 0; a number is a
    constant damping, a callable gets ``(evals, None, gammas, lambdas)``. The damped
    Newton step is multiplied by ``newton_fraction``. With a complement policy,
    ``−(ḡ − E Eᵀ ḡ)/ρ`` is added, ``E`` the selected eigenvectors; the policy sees
    the GGN's Rayleigh quotient along ``g_⊥ = ḡ − E Eᵀ ḡ``.
    """
    args = (model, loss_fn, list(params), X, y)
    G = reference.ggn(*args)
    Gn = reference.per_sample_ggns(*args)
    grads = reference.per_sample_gradients(*args)
    spectrum = torch.linalg.eigvalsh(G)
    spectrum = torch.where(spectrum > NOISE_LEVEL * spectrum.max(), spectrum, 0.0)
    if isinstance(criterion, int):
        num_directions = min(criterion, int((spectrum > 0).sum()))
    else:
        num_directions = len(criterion(spectrum))
    gammas, lambdas, evals, _ = reference.directional_derivatives(
        G, Gn, grads, num_directions
    )
    if callable(damping):
        delta = torch.as_tensor(damping(evals, None, gammas, lambdas))
    else:
        delta = torch.full(
            (num_directions,), float(damping), dtype=G.dtype, device=G.device
        )
    step = newton_fraction * reference.damped_newton_step(
        G, Gn, grads, num_directions, delta
    )
    rho = None
    if complement is not None:
        evecs = reference.directional_derivatives(G, Gn, grads, num_directions)[3]
        mean_gradient = grads.mean(0)
        orthogonal = mean_gradient - evecs @ (evecs.T @ mean_gradient)
        measured = (orthogonal @ G @ orthogonal) / (orthogonal @ orthogonal)
        rho = float(complement(lambdas.mean(0), delta, measured))
        step = step - orthogonal / rho
    return ReferenceStep(
        step, evals, gammas.mean(0), lambdas.mean(0), delta, spectrum, rho
    )


def snapshot(optimizer: DampedNewton) -> dict[str, Any]:
    """A deep copy of the optimizer's state dict (it holds references otherwise)."""
    return copy.deepcopy(optimizer.state_dict())


def saved_counters(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The step counters in a DampedNewton state dict (param group 0's records)."""
    return state_dict["param_groups"][0]["dampednewton"]["global"]


def assert_same_state(actual: Any, expected: Any, path: str = "state_dict") -> None:
    """Assert that two (nested) state dicts are equal; tensors bitwise."""
    if isinstance(expected, Tensor):
        assert isinstance(actual, Tensor), f"{path}: expected a tensor, got {actual!r}"
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), (
            f"{path}: tensors differ:\n  actual   {actual}\n  expected {expected}"
        )
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected a dict, got {actual!r}"
        assert set(actual) == set(expected), (
            f"{path}: keys differ: {sorted(map(str, actual))} vs "
            f"{sorted(map(str, expected))}"
        )
        for key in expected:
            assert_same_state(actual[key], expected[key], f"{path}[{key!r}]")
    elif isinstance(expected, float) and math.isnan(expected):
        assert isinstance(actual, float) and math.isnan(actual), (
            f"{path}: expected nan, got {actual!r}"
        )
    elif isinstance(expected, list | tuple):
        assert type(actual) is type(expected) and len(actual) == len(expected), (
            f"{path}: expected {expected!r}, got {actual!r}"
        )
        for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_state(a, e, f"{path}[{index}]")
    else:
        assert actual == expected, f"{path}: expected {expected!r}, got {actual!r}"


def assert_parameters_equal(params: Sequence[Tensor], expected: Sequence[Tensor]):
    """Assert that parameters are bitwise equal to the saved values."""
    assert len(params) == len(expected)
    for index, (param, value) in enumerate(zip(params, expected, strict=True)):
        assert torch.equal(param, value), f"parameter {index} changed"


def seeded(module_factory: Callable[[], nn.Module], generator: torch.Generator):
    """Build a float64 module with parameters ``~ N(0, 1/fan_in)`` from a generator.

    The module is created on the meta device, so torch's global random state is not
    used (see :func:`tests.cases.initialize`).
    """
    with torch.device("meta"):
        module = module_factory()
    return initialize(module, generator)


def reference_block(case: Case, params, subsampling_ggn, subsampling_grad):
    """GGN of the curvature samples, their per-sample GGNs, per-sample gradients."""
    ref_params = case.reference_params(params)
    model, loss_fn = case.reference_model, case.reference_loss_fn
    num_samples = case.X.shape[0]
    ggn_idx = list(range(num_samples)) if subsampling_ggn is None else subsampling_ggn
    grad_idx = (
        list(range(num_samples)) if subsampling_grad is None else subsampling_grad
    )
    G = reference.ggn(model, loss_fn, ref_params, case.X, case.y, ggn_idx)
    Gn = reference.per_sample_ggns(model, loss_fn, ref_params, case.X, case.y)[ggn_idx]
    grads = reference.per_sample_gradients(model, loss_fn, ref_params, case.X, case.y)
    return G, Gn, grads[grad_idx]


def is_simple(G: Tensor, k: int) -> bool:
    """Whether the top-k eigenvalues are simple (eigenvectors unique up to sign)."""
    evals = torch.linalg.eigvalsh(G)[-(k + 1) :]
    return bool((evals.diff() > 1e-6 * evals[-1]).all())


def flat_evecs(evecs: list[Tensor]) -> Tensor:
    """Eigenvectors in parameter-list format to columns ``[D, K]``."""
    return torch.cat([v.flatten(start_dim=1) for v in evecs], dim=1).T


def assert_eigenpairs(G: Tensor, evals: Tensor, evecs: Tensor) -> None:
    """Eigenvalues equal the top ones of ``G``; columns are orthonormal eigenvectors.

    This holds for repeated eigenvalues too, where eigenvectors are only defined up
    to a rotation; with simple eigenvalues they are also compared up to sign.
    """
    k = evals.numel()
    ref_evals, ref_evecs = reference.ggn_eigenpairs(G)
    assert_close(evals, ref_evals[-k:], rtol=1e-7, atol=1e-12, name="evals")
    scale = ref_evals[-1]
    assert_close(G @ evecs / scale, evecs * evals / scale, atol=1e-9, name="G e = λ e")
    eye = torch.eye(k, dtype=evecs.dtype, device=evecs.device)
    assert_close(evecs.T @ evecs, eye, atol=1e-9, name="orthonormal eigenvectors")
    if is_simple(G, k):
        assert_close_up_to_sign(evecs, ref_evecs[:, -k:], dim=-1, name="evecs")


def run_backward(computation, case: Case, groups: list[dict]) -> None:
    """One backward pass with the computation's extensions and hook."""
    hook = computation.get_extension_hook(groups)
    with backpack(*computation.get_extensions(), extension_hook=hook):
        case.loss_fn(case.model(case.X), case.y).backward()


def run_monitored_step(case: Case, monitor: DiagnosticsMonitor, step: int = 0) -> dict:
    """One backward pass through the context helper, then ``finish``."""
    case.model.zero_grad()
    loss = case.loss_fn(case.model(case.X), case.y)
    with monitor.backward_context(step):
        loss.backward()
    return monitor.finish(step, case.model.parameters(), loss)


def split_by_parameter(vector: Tensor, case: Case) -> dict[str, Tensor]:
    """Split a vector over all parameters into named per-parameter pieces."""
    names, params = zip(*case.model.named_parameters(), strict=True)
    pieces = reference.unflatten(vector, list(params))
    return dict(zip(names, pieces, strict=True))


def backpack_individual_gradients(case: Case) -> dict[str, Tensor]:
    """``N·grad_batch`` of every parameter from a plain BackPACK pass."""
    case.model.zero_grad()
    with backpack(BatchGrad()):
        case.loss_fn(case.model(case.X), case.y).backward()
    n = case.X.shape[0]
    result = {}
    for name, param in case.model.named_parameters():
        result[name] = param.grad_batch * n
        del param.grad_batch
    return result


def full_group(problem: Problem):
    """A fresh build of ``problem`` with all its parameters as the group."""
    model, loss_fn, X, y = problem.build()
    return model, loss_fn, list(model.parameters()), X, y


def num_nonzero(evals: Tensor, relative_tolerance: float = 1e-12) -> int:
    """The number of eigenvalues above ``relative_tolerance`` times the largest."""
    return int((evals > relative_tolerance * evals.max()).sum())


def mean_loss_of_parameters(
    model: nn.Module, loss_fn: nn.Module, params: list[Tensor], X: Tensor, y: Tensor
) -> Callable[[Tensor], Tensor]:
    """The batch loss as a function of the flattened group ``params``."""
    names_by_id = {id(p): name for name, p in model.named_parameters()}
    names = [names_by_id[id(p)] for p in params]

    def mean_loss(theta: Tensor) -> Tensor:
        overrides = dict(zip(names, reference.unflatten(theta, params), strict=True))
        return loss_fn(functional_call(model, overrides, (X,)), y)

    return mean_loss


def assert_square_root_gives_the_mse_ggn(model: nn.Module, X: Tensor, y: Tensor):
    """``VᵀV`` of the package's exact square root is the brute-force GGN (MSE loss).

    Extends ``model`` (in place) after computing the reference.
    """
    loss_fn = nn.MSELoss()
    expected = reference.ggn(model, loss_fn, list(model.parameters()), X, y)
    model, loss_fn = extend(model), extend(loss_fn)
    with backpack(ExactSqrtGGN()):
        loss_fn(model(X), y).backward()
    roots = [p.sqrt_ggn_exact.flatten(start_dim=2) for p in model.parameters()]
    flat_roots = torch.cat(roots, dim=2).flatten(end_dim=1)  # [C·N, D]
    assert_close(flat_roots.T @ flat_roots, expected, name="VᵀV vs the GGN")
