"""The four computations vs. brute-force float64 references (explicit GGN)."""

from __future__ import annotations

import pytest
import torch
from backpack import backpack
from torch import Tensor

from dampednewton import (
    DirectionalDampedNewtonComputation,
    DirectionalDerivativesComputation,
    EighComputation,
    EigvalshComputation,
    TopK,
)
from tests import reference
from tests.assertions import (
    assert_close,
    assert_close_up_to_sign,
    assert_close_with_direction_signs,
)
from tests.conftest import Case, build_case, make_groups

SUBSAMPLINGS = {
    "all-samples": (None, None),
    "subsampled": ([0, 2], [3, 1, 0]),
}
MAX_DIRECTIONS = 3


@pytest.fixture(params=list(SUBSAMPLINGS), ids=list(SUBSAMPLINGS))
def subsampling(request) -> tuple[list[int] | None, list[int] | None]:
    """``(subsampling_ggn, subsampling_grad)``."""
    return SUBSAMPLINGS[request.param]


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


def num_directions(G: Tensor) -> int:
    """At most ``MAX_DIRECTIONS``, and no more than the GGN's numerical rank."""
    evals = torch.linalg.eigvalsh(G)
    rank = int((evals > 1e-9 * evals.max()).sum())
    return min(MAX_DIRECTIONS, rank)


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
    eye = torch.eye(k, dtype=evecs.dtype)
    assert_close(evecs.T @ evecs, eye, atol=1e-9, name="orthonormal eigenvectors")
    if is_simple(G, k):
        assert_close_up_to_sign(evecs, ref_evecs[:, -k:], dim=-1, name="evecs")


def run(computation, case: Case, groups: list[dict]) -> None:
    """One backward pass with the computation's extensions and hook."""
    hook = computation.get_extension_hook(groups)
    with backpack(*computation.get_extensions(), extension_hook=hook):
        case.loss_fn(case.model(case.X), case.y).backward()


def test_eigvalsh(problem, block_structure, subsampling):
    case = build_case(problem)
    groups = make_groups(case.model, block_structure)
    computation = EigvalshComputation(subsampling=subsampling[0])
    run(computation, case, groups)
    for group in groups:
        G, _, _ = reference_block(case, group["params"], subsampling[0], None)
        gram_evals = computation.get_result(group)
        expected = torch.linalg.eigvalsh(G)
        common, ref_common = reference.match_spectra(gram_evals, expected)
        assert_close(common, ref_common, rtol=1e-7, atol=1e-12, name="eigenvalues")
        extra = reference.extra_eigenvalues(gram_evals, expected)
        assert_close(extra, torch.zeros_like(extra), atol=1e-12, name="zero evals")


def test_eigh(problem, block_structure, subsampling):
    case = build_case(problem)
    groups = make_groups(case.model, block_structure)
    blocks = [reference_block(case, g["params"], subsampling[0], None) for g in groups]
    for group, (G, _, _) in zip(groups, blocks, strict=True):
        group["criterion"] = TopK(num_directions(G))
    computation = EighComputation(subsampling=subsampling[0])
    run(computation, case, groups)
    for group, (G, _, _) in zip(groups, blocks, strict=True):
        evals, evecs = computation.get_result(group)
        assert [v.shape[1:] for v in evecs] == [p.shape for p in group["params"]]
        assert_eigenpairs(G, evals, flat_evecs(evecs))


def test_directional_derivatives(problem, block_structure, subsampling):
    subsampling_ggn, subsampling_grad = subsampling
    case = build_case(problem)
    groups = make_groups(case.model, block_structure)
    blocks = [reference_block(case, g["params"], *subsampling) for g in groups]
    for group, (G, _, _) in zip(groups, blocks, strict=True):
        group["criterion"] = TopK(num_directions(G))
    computation = DirectionalDerivativesComputation(
        subsampling_grad=subsampling_grad, subsampling_ggn=subsampling_ggn
    )
    eigh = EighComputation(subsampling=subsampling_ggn)
    run(computation, case, groups)
    run(eigh, case, groups)
    for group, (G, Gn, grads) in zip(groups, blocks, strict=True):
        k = group["criterion"].k
        gammas, lambdas = computation.get_result(group)
        evals, evecs = eigh.get_result(group)
        evecs = flat_evecs(evecs)
        assert_eigenpairs(G, evals, evecs)
        # Brute force along the computed (verified) eigenvectors ...
        assert_close(gammas, grads @ evecs, rtol=1e-7, atol=1e-12, name="gammas")
        expected_lambdas = torch.einsum("dk,nde,ek->nk", evecs, Gn, evecs)
        assert_close(lambdas, expected_lambdas, rtol=1e-7, atol=1e-12, name="lambdas")
        assert_close(lambdas.mean(0), evals, rtol=1e-7, name="mean λ_nk = λ_k")
        # ... and, where eigenvectors are unique up to sign, vs the reference's own.
        if is_simple(G, k):
            ref_gammas, ref_lambdas, _, ref_evecs = reference.directional_derivatives(
                G, Gn, grads, k
            )
            assert_close(lambdas, ref_lambdas, rtol=1e-7, atol=1e-12, name="lambdas")
            assert_close_with_direction_signs(
                gammas,
                ref_gammas,
                actual_directions=evecs,
                expected_directions=ref_evecs,
                rtol=1e-7,
                atol=1e-12,
                name="gammas",
            )


class IncreasingDamping:
    """δ_k = 0.1·(k+1): distinct per direction, to check the damping's order."""

    def __call__(self, evals, gram_evecs, gammas, lambdas) -> Tensor:
        return 0.1 * torch.arange(1, evals.numel() + 1, dtype=evals.dtype)


def test_damped_newton_step(problem, block_structure, subsampling):
    subsampling_ggn, subsampling_grad = subsampling
    case = build_case(problem)
    groups = make_groups(case.model, block_structure, damping=IncreasingDamping())
    blocks = [reference_block(case, g["params"], *subsampling) for g in groups]
    for group, (G, _, _) in zip(groups, blocks, strict=True):
        group["criterion"] = TopK(num_directions(G))
    computation = DirectionalDampedNewtonComputation(
        subsampling_grad=subsampling_grad, subsampling_ggn=subsampling_ggn
    )
    eigh = EighComputation(subsampling=subsampling_ggn)
    run(computation, case, groups)
    run(eigh, case, groups)
    for group, (G, Gn, grads) in zip(groups, blocks, strict=True):
        k = group["criterion"].k
        damping = 0.1 * torch.arange(1, k + 1, dtype=G.dtype)
        step = computation.get_result(group)
        assert [s.shape for s in step] == [p.shape for p in group["params"]]
        evecs = flat_evecs(eigh.get_result(group)[1])
        gamma_mean = (grads @ evecs).mean(0)
        lambda_mean = torch.einsum("dk,nde,ek->k", evecs, Gn, evecs) / Gn.shape[0]
        expected = evecs @ (-gamma_mean / (lambda_mean + damping))
        assert_close(reference.flatten(step), expected, rtol=1e-7, atol=1e-12, name="s")
        if is_simple(G, k):
            expected = reference.damped_newton_step(G, Gn, grads, k, damping)
            assert_close(
                reference.flatten(step), expected, rtol=1e-7, atol=1e-12, name="step"
            )
