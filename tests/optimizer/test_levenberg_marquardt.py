"""Levenberg-Marquardt damping: the reduction ratio and one update per policy object.

The reference is the quadratic model ``ḡᵀs + ½ sᵀGs`` with the explicit GGN and
gradient, and K-FAC's rule applied by hand.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dampednewton import (
    CurvatureAveraging,
    DampedNewton,
    GramBasis,
    LevenbergMarquardt,
    RelativeThreshold,
    SmallestCurvature,
)
from tests import reference
from tests.cases import PROBLEMS
from tests.utils import Case, build_case, copy_parameters, flat, make_closure

PROBLEM = {problem.id: problem for problem in PROBLEMS}
BATCH_GGN = {
    "basis": GramBasis(),
    "mc_samples": 0,
    "averaging": None,
    "kl_clip": None,
}
"""This batch's exact GGN, no trust region (the defaults average a Monte-Carlo GGN)."""


def ggn_and_mean_gradient(case: Case) -> tuple[Tensor, Tensor]:
    """Explicit GGN and mean gradient at the case's current parameters."""
    args = (case.reference_model, case.reference_loss_fn)
    reference_params = list(case.reference_model.parameters())
    copy_parameters(case.reference_model, case.model)
    G = reference.ggn(*args, reference_params, case.X, case.y)
    gradient = reference.per_sample_gradients(
        *args, reference_params, case.X, case.y
    ).mean(0)
    return G, gradient


def ratio_of_a_step(
    case: Case, optimizer: DampedNewton, gradient: Tensor, curvature: Tensor
) -> tuple[float, float]:
    """The step's recorded reduction ratio, and ``ΔL / (ḡᵀs + ½ sᵀ curvature s)``."""
    params = list(case.model.parameters())
    before = flat(params)
    loss = optimizer.step(
        make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    )
    update = flat(params) - before
    copy_parameters(case.reference_model, case.model)
    new_loss = case.reference_loss_fn(case.reference_model(case.X), case.y)
    predicted = gradient @ update + 0.5 * update @ curvature @ update
    expected = (new_loss - loss.detach()) / predicted
    return optimizer.records["global"]["reduction_ratio"], expected.item()


@pytest.mark.parametrize("complement", [None, SmallestCurvature()], ids=str)
def test_reduction_ratio_uses_the_full_quadratic_model(complement):
    """LM's ρ = (L(θ + lr·s) − L(θ)) / (lr·ḡᵀs + ½ lr²·sᵀGs), explicit G and ḡ."""
    lr = 0.6
    case = build_case(PROBLEM["mlp-ce"])
    params = list(case.model.parameters())
    optimizer = DampedNewton(
        params,
        lr=lr,
        damping=LevenbergMarquardt(value=0.5),
        criterion=3,
        complement=complement,
        warn_small_eigvals=0,
        **BATCH_GGN,
    )
    G, gradient = ggn_and_mean_gradient(case)
    actual, expected = ratio_of_a_step(case, optimizer, gradient, G)
    assert actual == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize(
    "criterion", [RelativeThreshold(0.3), 3], ids=["relative", "top-3"]
)
def test_reduction_ratio_with_averaging_uses_the_averaged_curvature_everywhere(
    criterion,
):
    """With averaging the model is ``ḡᵀs + ½ sᵀḠs`` for the averaged GGN ``Ḡ``.

    At the first refresh ``Ḡ`` holds the top ``rank`` eigenpairs of this batch's GGN
    (bias-corrected); a criterion that keeps fewer of them leaves the complement
    step components along the others, whose curvature counts too. Explicit ``G``.
    """
    case = build_case(PROBLEM["mlp-mse"])
    params = list(case.model.parameters())
    optimizer = DampedNewton(
        params,
        damping=LevenbergMarquardt(value=0.05),
        criterion=criterion,
        complement=SmallestCurvature(),
        averaging=CurvatureAveraging(decay=0.6, rank=8, interval=1, ramp=False),
        basis=GramBasis(),
        mc_samples=0,
        kl_clip=None,
        warn_small_eigvals=0,
    )
    G, gradient = ggn_and_mean_gradient(case)
    evals, evecs = torch.linalg.eigh(G)
    averaged = evecs[:, -8:] @ torch.diag(evals[-8:]) @ evecs[:, -8:].T
    actual, expected = ratio_of_a_step(case, optimizer, gradient, averaged)
    assert actual == pytest.approx(expected, rel=1e-8)


def test_shared_levenberg_marquardt_policy_adapts_once_per_step():
    """One policy object in several groups (torch's default) is updated once a step."""
    case = build_case(PROBLEM["mlp-ce"])
    policy = LevenbergMarquardt(value=1.0, decrease=0.5, increase=2.0)
    groups = [{"params": [p]} for p in case.model.parameters()]
    optimizer = DampedNewton(
        groups, damping=policy, criterion=2, warn_small_eigvals=0, **BATCH_GGN
    )
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    assert policy.updates == 1
    assert policy.value in (0.5, 1.0, 2.0)


def levenberg_marquardt_rule(policy: LevenbergMarquardt, ratio: float) -> float:
    """K-FAC's rule by hand: grow below 1/4, shrink above 3/4, else keep."""
    if ratio < 0.25:
        return policy.value * policy.increase
    if ratio > 0.75:
        return policy.value * policy.decrease
    return policy.value


@pytest.mark.parametrize(
    "owners",
    [(0, 1, 2, 3), (0, 1, 2, 2), (0, 0, 0, 0)],
    ids=["own-objects", "two-own-one-shared", "one-shared"],
)
def test_levenberg_marquardt_adapts_each_policy_object_once(owners):
    """Four per-layer groups: every policy object moves by one LM factor, not more.

    ``owners[i]`` is the policy object of group ``i``. The reduction ratio is
    computed by hand from the explicit block-diagonal GGN (one block per group) and
    the losses before and after the step.
    """
    case = build_case(PROBLEM["mlp-ce"])
    params = list(case.model.parameters())
    assert len(params) == 4
    policies = [
        LevenbergMarquardt(value=1.0, decrease=0.5, increase=2.0)
        for _ in range(max(owners) + 1)
    ]
    groups = [
        {"params": [p], "damping": policies[owner]}
        for p, owner in zip(params, owners, strict=True)
    ]
    optimizer = DampedNewton(groups, criterion=2, warn_small_eigvals=0, **BATCH_GGN)
    G, gradient = ggn_and_mean_gradient(case)
    before = flat(params)
    expected_before = [policy.value for policy in policies]

    loss = optimizer.step(
        make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    )

    update = flat(params) - before
    group_of = torch.cat([torch.full((p.numel(),), i) for i, p in enumerate(params)])
    blocks = G * (group_of[:, None] == group_of[None, :])
    copy_parameters(case.reference_model, case.model)
    new_loss = case.reference_loss_fn(case.reference_model(case.X), case.y)
    predicted = gradient @ update + 0.5 * update @ blocks @ update
    ratio = ((new_loss - loss.detach()) / predicted).item()
    assert optimizer.records["global"]["reduction_ratio"] == pytest.approx(
        ratio, rel=1e-9
    )
    expected = [
        levenberg_marquardt_rule(
            LevenbergMarquardt(value=value, decrease=0.5, increase=2.0), ratio
        )
        for value in expected_before
    ]
    assert all(value != 1.0 for value in expected), "the case must move δ"
    assert [policy.value for policy in policies] == expected
    assert [policy.updates for policy in policies] == [1] * len(policies)


@pytest.mark.parametrize("basis", ["kronecker", "gram"])
def test_a_policy_adapted_by_another_optimizer_is_refused(basis):
    """Two optimizers of one LM object: the second step refuses, changing nothing.

    Both would move one ``δ`` by their own steps. Once the first optimizer is gone
    (a notebook cell run again, a stored Hydra partial called again), the object
    serves the next one, which continues from its adapted state with a warning.
    """
    options = BATCH_GGN if basis == "gram" else {}
    case = build_case(PROBLEM["mlp-ce"])
    other = build_case(PROBLEM["mlp-ce"])
    policy = LevenbergMarquardt(value=1.0)
    first = DampedNewton(other.model.parameters(), damping=policy, **options)
    first.step(make_closure(first, other.model, other.loss_fn, other.X, other.y))
    value, updates = policy.value, policy.updates
    second = DampedNewton(case.model.parameters(), damping=policy, **options)
    params = [p.detach().clone() for p in case.model.parameters()]

    with pytest.raises(ValueError, match="another DampedNewton optimizer"):
        second.step(make_closure(second, case.model, case.loss_fn, case.X, case.y))

    assert all(
        torch.equal(p, q) for p, q in zip(params, case.model.parameters(), strict=True)
    )
    assert (policy.value, policy.updates) == (value, updates)
    assert second.records["global"]["step"] == 0
    del first
    with pytest.warns(UserWarning, match="adapted by an earlier DampedNewton"):
        second.step(make_closure(second, case.model, case.loss_fn, case.X, case.y))
    assert policy.updates == updates + 1


@pytest.mark.parametrize("basis", [None, GramBasis()], ids=["kronecker", "gram"])
def test_levenberg_marquardt_adapts_on_curvature_refreshes_only(basis):
    """Both bases refresh at steps 0, 1, 3, 7: only those call the closure twice.

    The second call (the loss at the moved parameters) is the adaptation's, so the
    policy's ``interval`` counts refreshes (docs/usage.md).
    """
    case = build_case(PROBLEM["mlp-ce"])
    damping = LevenbergMarquardt(value=3e-3, interval=1)
    optimizer = DampedNewton(
        case.model.parameters(),
        seed=0,
        damping=damping,
        **({} if basis is None else {"basis": basis}),
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    calls = []

    def counted() -> Tensor:
        calls[-1] += 1
        return closure()

    for _ in range(10):
        calls.append(0)
        optimizer.step(counted)
    assert [step for step, count in enumerate(calls) if count == 2] == [0, 1, 3, 7]
    assert set(calls) == {1, 2} and damping.updates == 4
