"""Curvature averaging and the complement vs the explicit moving average of the GGN.

The reference is the explicit GGN's moving average, truncated to rank ``r`` as the
factor is, compared in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dampednewton import (
    CurvatureAveraging,
    DampedNewton,
    GramBasis,
    KroneckerBasis,
    MeasuredCurvature,
    SmallestCurvature,
)
from tests import reference
from tests.assertions import assert_close
from tests.cases import PROBLEMS
from tests.utils import NOISE_LEVEL, build_case, copy_parameters, flat, make_closure

PROBLEM = {problem.id: problem for problem in PROBLEMS}


TOLERANCE = 1e-9
"""Relative to the largest entry: float64 round-off, amplified over a few steps."""


def truncated(matrix: Tensor, rank: int) -> Tensor:
    """The best rank-``rank`` PSD approximation (numerically zero modes dropped)."""
    evals, evecs = torch.linalg.eigh(matrix)
    keep = evals > NOISE_LEVEL * evals.max()
    evals, evecs = evals[keep][-rank:], evecs[:, keep][:, -rank:]
    return evecs @ torch.diag(evals) @ evecs.T


def averaged_reference_step(
    average: Tensor,
    gradient: Tensor,
    k: int,
    damping: float,
    newton_fraction: float,
    batch_ggn: Tensor | None = None,
    complement_curvature: Tensor | None = None,
) -> tuple[Tensor, float, Tensor]:
    """``φ`` × the damped Newton step on ``average``'s top ``k``, and the complement.

    ``k = 0`` selects the flattest kept eigenvector instead (:func:`flattest`).

    ``ρ = λ_min + δ`` (:class:`SmallestCurvature`), or with ``batch_ggn`` (the
    :class:`MeasuredCurvature` policy on a refresh) ``max(λ_min, q_⊥) + δ``, where
    ``q_⊥`` is ``batch_ggn``'s Rayleigh quotient along ``g_⊥ = ḡ − E Eᵀ ḡ``.

    Between refreshes the step reuses the refresh's ``ρ`` (``complement_curvature``).

    Returns:
        The step, ``q_⊥ − λ_min`` (0 without ``batch_ggn``) and ``ρ``.
    """
    evals, evecs = torch.linalg.eigh(average)
    keep = evals > NOISE_LEVEL * evals.max()
    selected = slice(None, 1) if k == 0 else slice(-k, None)
    evals, evecs = evals[keep][selected], evecs[:, keep][:, selected]
    slopes = evecs.T @ gradient
    orthogonal = gradient - evecs @ slopes
    curvature = evals.min()
    measured = 0.0
    if batch_ggn is not None:
        measured = (orthogonal @ batch_ggn @ orthogonal) / (orthogonal @ orthogonal)
        curvature = torch.maximum(curvature, measured)
    step = newton_fraction * (evecs @ (-slopes / (evals + damping)))
    rho = curvature + damping if complement_curvature is None else complement_curvature
    return step - orthogonal / rho, float(measured - evals.min()), rho


def flattest(evals: Tensor) -> list[int]:
    """A criterion that keeps the flattest direction only: the complement is steep."""
    return [0]


@pytest.mark.parametrize(
    ("problem_id", "rank", "interval", "kl_clip", "complement", "newton_fraction"),
    [
        ("mlp-ce", 3, 1, None, "smallest", 0.3),
        ("mlp-ce", 1000, 1, None, "smallest", 1.0),
        ("mlp-ce", 3, 2, None, "smallest", 0.3),
        ("mlp-ce", 3, 1, 1e-3, "smallest", 0.6),
        ("cnn-ce", 4, 1, None, "smallest", 0.3),
        ("cnn-ce", 4, 2, 1e-3, "smallest", 1.0),
        ("seq-ce", 5, 1, None, "smallest", 0.3),
        ("mlp-mse", 1000, 3, None, "smallest", 0.3),
        ("mlp-ce", 3, 1, None, "measured", 0.3),
        ("cnn-ce", 4, 2, 1e-3, "measured", 1.0),
        ("seq-ce", 5, 1, None, "measured", 0.3),
    ],
    ids=lambda value: str(value),
)
def test_averaged_curvature_matches_explicit_moving_average(
    problem_id: str,
    rank: int,
    interval: int,
    kl_clip: float | None,
    complement: str,
    newton_fraction: float,
):
    """Five steps: ``B Bᵀ/(1 − β^t)`` and the steps equal the dense recursion.

    Between refreshes the steps take the frozen basis of the last refresh with its
    damping and complement curvature ``ρ`` and this batch's gradient.

    The reference keeps ``A_t = trunc_r(β A_{t−1} + (1 − β) G_t)`` of explicit GGNs at
    the parameters of each refresh (exact: the factor update is exact in its
    subspace), bias-corrects it, and steps ``φ`` of the damped Newton step along its
    top-``k`` eigenvectors, plus the complement. With a trust region, ``ν`` bounds
    ``max(−ḡᵀs, sᵀG_t s)`` on refreshes (this batch's GGN is known) and ``−ḡᵀs`` in
    between. :class:`MeasuredCurvature` raises ``ρ`` to this batch's curvature along
    the complement on refreshes; its cases keep only the flattest direction of the
    average, so that it does (the comparison discriminates).
    """
    measured = complement == "measured"
    decay, damping, lr = 0.7, 0.3, 0.5
    k = 0 if measured else 2
    case = build_case(PROBLEM[problem_id])
    params = list(case.model.parameters())
    reference_params = list(case.reference_model.parameters())
    averaging = CurvatureAveraging(
        decay=decay, rank=rank, interval=interval, ramp=False
    )
    optimizer = DampedNewton(
        params,
        basis=GramBasis(),
        complement=MeasuredCurvature() if measured else SmallestCurvature(),
        lr=lr,
        damping=damping,
        criterion=k if k else flattest,
        newton_fraction=newton_fraction,
        averaging=averaging,
        mc_samples=0,
        kl_clip=kl_clip,
        warn_small_eigvals=0,
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    average, updates, largest_excess = None, 0, -torch.inf
    rho = refresh_length = eta = torch.tensor(torch.nan)
    for step in range(5):
        copy_parameters(case.reference_model, case.model)
        args = (case.reference_model, case.reference_loss_fn, reference_params)
        if step % interval == 0:
            G = reference.ggn(*args, case.X, case.y)
            average = (1 - decay) * G if average is None else decay * average
            average = truncated(average + (0 if step == 0 else (1 - decay) * G), rank)
            updates += 1
        gradient = reference.per_sample_gradients(*args, case.X, case.y).mean(0)
        corrected = average / (1 - decay**updates)
        refresh = step % interval == 0
        step_direction, excess, rho = averaged_reference_step(
            corrected,
            gradient,
            k,
            damping,
            newton_fraction,
            G if measured and refresh else None,
            None if refresh else rho,
        )
        largest_excess = max(largest_excess, excess)
        scale = 1.0
        if kl_clip is not None:
            bound = 2 * kl_clip
            curvature = -(gradient @ step_direction)
            if refresh:
                # Between refreshes the batch GGN's excess over the model (η) and
                # the refresh's step length L guard the trust region instead.
                eta = max(1.0, (step_direction @ G @ step_direction) / curvature)
                curvature = curvature * eta
            else:
                length = step_direction.square().sum() / refresh_length**2
                curvature = max(curvature * eta, bound * length)
            scale = min(1.0, (bound / curvature).sqrt().item())
            if refresh:
                refresh_length = scale * step_direction.norm()
            if step == 0:
                assert scale < 1, "the trust region must be active in this case"
        expected = lr * scale * step_direction
        before = flat(params)

        optimizer.step(closure)

        name = f"{problem_id} step {step}"
        assert_close(
            flat(params) - before,
            expected,
            rtol=0,
            atol=TOLERANCE * expected.abs().max().item(),
            name=f"{name}: parameter change",
        )
        basis = torch.cat(
            [optimizer.state[p]["curvature_basis"].flatten(1) for p in params], dim=1
        )
        stats = optimizer.records["groups"][0]
        assert stats["curvature_updates"] == updates
        assert_close(
            basis.T @ basis,
            average,
            rtol=0,
            atol=TOLERANCE * average.abs().max().item(),
            name=f"{name}: B Bᵀ vs the truncated moving average",
        )
    if measured:
        assert largest_excess > 0, "q_⊥ never exceeded λ_min: the case cannot tell"


SCHEDULE_ONLY = {  # each basis' default schedule, without the loss's trigger
    "kronecker": (
        KroneckerBasis(),
        CurvatureAveraging(decay=0.95, interval=15, loss_tolerance=None),
        [0, 1, 3, 7, 15, 30, 45],
    ),
    "gram": (
        GramBasis(),
        CurvatureAveraging(loss_tolerance=None),
        [0, 1, 3, 7, 15, 31, 51],
    ),
}


@pytest.mark.parametrize("basis", list(SCHEDULE_ONLY))
def test_a_group_added_later_ramps_up_from_its_first_refresh(basis):
    """A layer joins with ``add_param_group`` at step 20.

    Its schedule (refreshes 0, 1, 3, 7, 15, …) counts from there, also after a
    checkpoint at step 30; the first group's stays.
    """
    policy, averaging, schedule = SCHEDULE_ONLY[basis]
    case = build_case(PROBLEMS[0])
    first, last = case.model[0], case.model[-1]
    first.requires_grad_(False)
    options = {"seed": 0, "basis": policy, "averaging": averaging}
    optimizer = DampedNewton(last.parameters(), **options)
    refreshed: list[list[int]] = [[], []]
    for step in range(60):
        if step == 20:
            first.requires_grad_(True)
            optimizer.add_param_group({"params": list(first.parameters())})
        if step == 30:  # resume from a checkpoint
            saved = optimizer.state_dict()
            groups = [{"params": list(layer.parameters())} for layer in (last, first)]
            optimizer = DampedNewton(groups, **options)
            optimizer.load_state_dict(saved)
        before = [
            s.get("curvature_updates", 0) for s in optimizer.records.get("groups", [])
        ]
        optimizer.step(
            make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
        )
        for index, stats in enumerate(optimizer.records["groups"]):
            if stats.get("curvature_updates", 0) != [*before, 0][index]:
                refreshed[index].append(step)
    assert refreshed[0] == schedule
    assert refreshed[1] == [20 + step for step in schedule if 20 + step < 60]
