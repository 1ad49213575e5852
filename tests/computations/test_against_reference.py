"""The four computations vs. brute-force float64 references (explicit GGN)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dampednewton import (
    DirectionalDampedNewtonComputation,
    DirectionalDerivativesComputation,
    EighComputation,
    EigvalshComputation,
    TopK,
)
from tests import reference
from tests.assertions import assert_close, assert_close_with_direction_signs
from tests.utils import (
    assert_eigenpairs,
    build_case,
    flat_evecs,
    is_simple,
    make_groups,
    reference_block,
    run_backward,
)

SUBSAMPLINGS = {
    "all-samples": (None, None),
    "subsampled": ([0, 2], [3, 1, 0]),
}
MAX_DIRECTIONS = 3


@pytest.fixture(params=list(SUBSAMPLINGS), ids=list(SUBSAMPLINGS))
def subsampling(request) -> tuple[list[int] | None, list[int] | None]:
    """``(subsampling_ggn, subsampling_grad)``."""
    return SUBSAMPLINGS[request.param]


def num_directions(G: Tensor) -> int:
    """At most ``MAX_DIRECTIONS``, and no more than the GGN's numerical rank."""
    evals = torch.linalg.eigvalsh(G)
    rank = int((evals > 1e-9 * evals.max()).sum())
    return min(MAX_DIRECTIONS, rank)


def test_eigvalsh(problem, block_structure, subsampling, device):
    case = build_case(problem, device=device)
    groups = make_groups(case.model, block_structure)
    computation = EigvalshComputation(subsampling=subsampling[0])
    run_backward(computation, case, groups)
    for group in groups:
        G, _, _ = reference_block(case, group["params"], subsampling[0], None)
        gram_evals = computation.get_result(group)
        expected = torch.linalg.eigvalsh(G)
        common, ref_common = reference.match_spectra(gram_evals, expected)
        assert_close(common, ref_common, rtol=1e-7, atol=1e-12, name="eigenvalues")
        extra = reference.extra_eigenvalues(gram_evals, expected)
        assert_close(extra, torch.zeros_like(extra), atol=1e-12, name="zero evals")


def test_eigh(problem, block_structure, subsampling, device):
    case = build_case(problem, device=device)
    groups = make_groups(case.model, block_structure)
    blocks = [reference_block(case, g["params"], subsampling[0], None) for g in groups]
    for group, (G, _, _) in zip(groups, blocks, strict=True):
        group["criterion"] = TopK(num_directions(G))
    computation = EighComputation(subsampling=subsampling[0])
    run_backward(computation, case, groups)
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
    run_backward(computation, case, groups)
    run_backward(eigh, case, groups)
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
        return 0.1 * torch.arange(
            1, evals.numel() + 1, dtype=evals.dtype, device=evals.device
        )


def test_damped_newton_step(problem, block_structure, subsampling, device):
    subsampling_ggn, subsampling_grad = subsampling
    case = build_case(problem, device=device)
    groups = make_groups(case.model, block_structure, damping=IncreasingDamping())
    blocks = [reference_block(case, g["params"], *subsampling) for g in groups]
    for group, (G, _, _) in zip(groups, blocks, strict=True):
        group["criterion"] = TopK(num_directions(G))
    computation = DirectionalDampedNewtonComputation(
        subsampling_grad=subsampling_grad, subsampling_ggn=subsampling_ggn
    )
    eigh = EighComputation(subsampling=subsampling_ggn)
    run_backward(computation, case, groups)
    run_backward(eigh, case, groups)
    for group, (G, Gn, grads) in zip(groups, blocks, strict=True):
        k = group["criterion"].k
        damping = 0.1 * torch.arange(1, k + 1, dtype=G.dtype, device=G.device)
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
