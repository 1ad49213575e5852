"""Complement, curvature averaging, trust region, momentum and weight decay.

Each piece is compared in float64 with a brute-force reference: the explicit GGN (and
its explicit moving average, truncated to rank ``r`` as the factor is), the parameter
updates of a twin optimizer without the piece, and the quadratic model ``ḡᵀs +
½ sᵀGs`` of Levenberg-Marquardt's reduction ratio.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dampednewton import (
    CurvatureAveraging,
    DampedNewton,
    LevenbergMarquardt,
    MeasuredCurvature,
    SmallestCurvature,
)
from tests import reference
from tests.assertions import assert_close
from tests.cases import PROBLEMS
from tests.utils import (
    NOISE_LEVEL,
    assert_same_state,
    build_case,
    copy_parameters,
    flat,
    make_closure,
    snapshot,
)

PROBLEM = {problem.id: problem for problem in PROBLEMS}
BATCH_GGN = {"mc_samples": 0, "averaging": None, "kl_clip": None}
"""This batch's exact GGN, no trust region (the defaults average a Monte-Carlo GGN)."""
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
    batch_ggn: Tensor | None = None,
) -> tuple[Tensor, float]:
    """Damped Newton step on ``average``'s top ``k`` eigenvectors plus the complement.

    ``k = 0`` selects the flattest kept eigenvector instead (:func:`flattest`).

    ``ρ = λ_min + δ`` (:class:`SmallestCurvature`), or with ``batch_ggn`` (the
    :class:`MeasuredCurvature` policy on a refresh) ``max(λ_min, q_⊥) + δ``, where
    ``q_⊥`` is ``batch_ggn``'s Rayleigh quotient along ``g_⊥ = ḡ − E Eᵀ ḡ``.

    Returns:
        The step and ``q_⊥ − λ_min`` (0 without ``batch_ggn``).
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
    step = evecs @ (-slopes / (evals + damping))
    return step - orthogonal / (curvature + damping), float(measured - evals.min())


def flattest(evals: Tensor) -> list[int]:
    """A criterion that keeps the flattest direction only: the complement is steep."""
    return [0]


@pytest.mark.parametrize(
    ("problem_id", "rank", "interval", "kl_clip", "complement"),
    [
        ("mlp-ce", 3, 1, None, "smallest"),
        ("mlp-ce", 1000, 1, None, "smallest"),
        ("mlp-ce", 3, 2, None, "smallest"),
        ("mlp-ce", 3, 1, 1e-3, "smallest"),
        ("cnn-ce", 4, 1, None, "smallest"),
        ("cnn-ce", 4, 2, 1e-3, "smallest"),
        ("seq-ce", 5, 1, None, "smallest"),
        ("mlp-mse", 1000, 3, None, "smallest"),
        ("mlp-ce", 3, 1, None, "measured"),
        ("cnn-ce", 4, 2, 1e-3, "measured"),
        ("seq-ce", 5, 1, None, "measured"),
    ],
    ids=lambda value: str(value),
)
def test_averaged_curvature_matches_explicit_moving_average(
    problem_id: str,
    rank: int,
    interval: int,
    kl_clip: float | None,
    complement: str,
):
    """Five steps: ``B Bᵀ/(1 − β^t)`` and the steps equal the dense recursion.

    The reference keeps ``A_t = trunc_r(β A_{t−1} + (1 − β) G_t)`` of explicit GGNs at
    the parameters of each refresh (exact: the factor update is exact in its
    subspace), bias-corrects it, and steps along its top-``k`` eigenvectors. With a
    trust region, ``ν`` bounds ``max(−ḡᵀs, sᵀG_t s)`` on refreshes (this batch's GGN
    is known) and ``−ḡᵀs`` in between. :class:`MeasuredCurvature` raises ``ρ`` to this
    batch's curvature along the complement on refreshes; its cases keep only the
    flattest direction of the average, so that it does (the comparison discriminates).
    """
    measured = complement == "measured"
    decay, damping, lr = 0.7, 0.3, 0.5
    k = 0 if measured else 2
    case = build_case(PROBLEM[problem_id])
    params = list(case.model.parameters())
    reference_params = list(case.reference_model.parameters())
    averaging = CurvatureAveraging(decay=decay, rank=rank, interval=interval)
    optimizer = DampedNewton(
        params,
        complement=MeasuredCurvature() if measured else SmallestCurvature(),
        lr=lr,
        damping=damping,
        criterion=k if k else flattest,
        averaging=averaging,
        mc_samples=0,
        kl_clip=kl_clip,
        warn_small_eigvals=0,
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    average, updates, largest_excess = None, 0, -torch.inf
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
        step_direction, excess = averaged_reference_step(
            corrected, gradient, k, damping, G if measured and refresh else None
        )
        largest_excess = max(largest_excess, excess)
        scale = 1.0
        if kl_clip is not None:
            curvature = -(gradient @ step_direction)
            if step % interval == 0:
                curvature = max(curvature, step_direction @ G @ step_direction)
            scale = min(1.0, (2 * kl_clip / (lr**2 * curvature)).sqrt().item())
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
        stats = optimizer.state["groups"][0]
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


def twin_steps(
    problem_id: str, steps: int, **settings
) -> list[tuple[Tensor, Tensor, Tensor, Tensor, Tensor]]:
    """Per step: update with ``settings``; plain step, ḡ, θ and G at the same θ."""
    case = build_case(PROBLEM[problem_id])
    twin = build_case(PROBLEM[problem_id])
    params, twin_params = list(case.model.parameters()), list(twin.model.parameters())
    common = {
        "damping": 0.5,
        "criterion": 3,
        "warn_small_eigvals": 0,
        "mc_samples": 0,
        "averaging": None,
    }
    optimizer = DampedNewton(params, **common, **settings)
    plain = DampedNewton(twin_params, lr=1.0, kl_clip=None, **common)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    twin_closure = make_closure(plain, twin.model, twin.loss_fn, twin.X, twin.y)
    records = []
    for _ in range(steps):
        copy_parameters(twin.model, case.model)
        copy_parameters(twin.reference_model, case.model)
        G = reference.ggn(
            twin.reference_model,
            twin.reference_loss_fn,
            list(twin.reference_model.parameters()),
            twin.X,
            twin.y,
        )
        before = flat(params)
        plain.step(twin_closure)
        gradient = flat([p.grad for p in twin_params])
        step = flat(twin_params) - before
        optimizer.step(closure)
        records.append((flat(params) - before, step, gradient, before, G))
    return records


@pytest.mark.parametrize("nesterov", [False, True], ids=["heavy-ball", "nesterov"])
def test_momentum_and_weight_decay_follow_their_rules(nesterov: bool):
    """``m ← μm + s``, ``θ ← (1 − lr·wd)θ + lr·m`` (Nesterov: ``lr·(s + μm)``)."""
    lr, mu, decay = 0.3, 0.8, 0.05
    records = twin_steps(
        "mlp-ce",
        4,
        lr=lr,
        momentum=mu,
        nesterov=nesterov,
        weight_decay=decay,
        kl_clip=None,
    )
    buffer = None
    for index, (update, step, _, before, _) in enumerate(records):
        buffer = step if buffer is None else mu * buffer + step
        direction = step + mu * buffer if nesterov else buffer
        expected = -lr * decay * before + lr * direction
        assert_close(
            update,
            expected,
            rtol=0,
            atol=TOLERANCE * expected.abs().max().item(),
            name=f"step {index}",
        )


@pytest.mark.parametrize("kl_clip", [1e-4, 1e-2, 10.0])
def test_trust_region_bounds_the_damped_model(kl_clip: float):
    """``ν = min(1, √(2κ / (lr² max(−ḡᵀs, sᵀGs))))`` scales the step (explicit G)."""
    lr = 0.7
    records = twin_steps("cnn-ce", 3, lr=lr, kl_clip=kl_clip)
    scales = []
    for index, (update, step, gradient, _, G) in enumerate(records):
        damped_curvature = -(gradient @ step)
        assert damped_curvature > 0, "the step must be a descent direction"
        curvature = torch.maximum(damped_curvature, step @ G @ step)
        scale = min(1.0, (2 * kl_clip / (lr**2 * curvature)).sqrt().item())
        scales.append(scale)
        expected = lr * scale * step
        assert_close(
            update,
            expected,
            rtol=0,
            atol=TOLERANCE * expected.abs().max().item(),
            name=f"κ={kl_clip} step {index}",
        )
    if kl_clip == 10.0:
        assert scales == [1.0] * 3
    if kl_clip == 1e-4:
        assert max(scales) < 1


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
    args = (case.reference_model, case.reference_loss_fn)
    reference_params = list(case.reference_model.parameters())
    copy_parameters(case.reference_model, case.model)
    G = reference.ggn(*args, reference_params, case.X, case.y)
    gradient = reference.per_sample_gradients(
        *args, reference_params, case.X, case.y
    ).mean(0)
    before = flat(params)

    loss = optimizer.step(
        make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    )

    update = flat(params) - before
    copy_parameters(case.reference_model, case.model)
    new_loss = case.reference_loss_fn(case.reference_model(case.X), case.y)
    predicted = gradient @ update + 0.5 * update @ G @ update
    expected = (new_loss - loss.detach()) / predicted
    actual = optimizer.state["global"]["reduction_ratio"]
    assert actual == pytest.approx(expected.item(), rel=1e-9)


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
    args = (case.reference_model, case.reference_loss_fn)
    reference_params = list(case.reference_model.parameters())
    copy_parameters(case.reference_model, case.model)
    G = reference.ggn(*args, reference_params, case.X, case.y)
    gradient = reference.per_sample_gradients(
        *args, reference_params, case.X, case.y
    ).mean(0)
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
    assert optimizer.state["global"]["reduction_ratio"] == pytest.approx(
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


def test_averaged_momentum_state_round_trips(tmp_path):
    """Factor, weights and momentum survive torch.save/load: lock-step afterwards."""
    settings = {
        "damping": 0.5,
        "criterion": 2,
        "averaging": CurvatureAveraging(decay=0.9, rank=4, interval=2),
        "momentum": 0.9,
        "nesterov": True,
        "weight_decay": 0.01,
        "kl_clip": 0.1,
        "mc_samples": 1,
        "seed": 3,
        "warn_small_eigvals": 0,
    }
    case = build_case(PROBLEM["mlp-ce"])
    optimizer = DampedNewton(case.model.parameters(), **settings)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    for _ in range(3):
        optimizer.step(closure)
    path = tmp_path / "state.pt"
    torch.save(optimizer.state_dict(), path)

    twin = build_case(PROBLEM["mlp-ce"])
    copy_parameters(twin.model, case.model)
    resumed = DampedNewton(twin.model.parameters(), **settings)
    resumed.load_state_dict(torch.load(path, weights_only=True))
    twin_closure = make_closure(resumed, twin.model, twin.loss_fn, twin.X, twin.y)
    for _ in range(3):
        optimizer.step(closure)
        resumed.step(twin_closure)
        assert torch.equal(flat(case.model.parameters()), flat(twin.model.parameters()))
    assert resumed.state["groups"][0]["curvature_updates"] == 3


def test_refused_step_keeps_factor_and_momentum():
    """A NaN loss on an averaged, momentum step leaves every state entry unchanged."""
    case = build_case(PROBLEM["mlp-ce"])
    optimizer = DampedNewton(
        case.model.parameters(),
        damping=0.5,
        criterion=2,
        averaging=CurvatureAveraging(rank=3),
        mc_samples=0,
        momentum=0.5,
        warn_small_eigvals=0,
    )
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    saved = snapshot(optimizer)
    values = [p.detach().clone() for p in case.model.parameters()]
    bad_inputs = case.X.clone()
    bad_inputs[0] = torch.nan
    with pytest.raises(FloatingPointError, match="parameters unchanged"):
        optimizer.step(
            make_closure(optimizer, case.model, case.loss_fn, bad_inputs, case.y)
        )
    for param, value in zip(case.model.parameters(), values, strict=True):
        assert torch.equal(param, value)
    assert_same_state(snapshot(optimizer), saved)
