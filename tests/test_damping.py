"""Damping policies: formulas vs brute force, limits, state and serialization."""

from __future__ import annotations

import dataclasses
import inspect
import io
import math
import pickle

import pytest
import torch

from dampednewton import (
    ConstantDamping,
    GSNRDamping,
    LevenbergMarquardt,
    NoiseAwareDamping,
    RelativeDamping,
)
from dampednewton.math.gram_space import newton_coefficients
from dampednewton.policies import complement as complement_module
from dampednewton.policies import criteria as criteria_module
from dampednewton.policies import damping as damping_module
from dampednewton.policies.damping import (
    AdaptiveDamping,
    Damping,
    MeanStatisticsDamping,
    as_damping,
    needs_sample_statistics,
)
from dampednewton.policies.damping_values import checked_damping
from tests.assertions import assert_close

NUM_DIRECTIONS = 4


def directional_samples(seed: int, noise: float, num_samples: int = 16):
    """Per-sample slopes and curvatures around fixed means."""
    generator = torch.Generator().manual_seed(seed)
    gamma_mean = torch.tensor([1.0, -0.5, 0.05, 2.0], dtype=torch.float64)
    lambda_mean = torch.tensor([0.1, 0.5, 1.0, 3.0], dtype=torch.float64)
    shape = (num_samples, NUM_DIRECTIONS)
    gammas = gamma_mean + noise * torch.randn(shape, generator=generator).double()
    lambdas = (
        lambda_mean * (1 + noise * torch.rand(shape, generator=generator)).double()
    )
    evals = lambdas.mean(0)
    return evals, None, gammas, lambdas


POLICIES = {
    "noise-aware": NoiseAwareDamping(base=1e-2, z=2.0),
    "gsnr": GSNRDamping(base=1e-2),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_reduces_to_constant_damping_without_noise(name):
    evals, _, gammas, lambdas = directional_samples(0, noise=0.0)
    damping = POLICIES[name](evals, None, gammas, lambdas)
    assert_close(damping, torch.full_like(evals, 1e-2), rtol=1e-12, name=name)


def test_noise_aware_step_is_the_pessimistic_newton_step():
    """Brute force per direction: minimum of the pessimistic quadratic model."""
    policy = NoiseAwareDamping(base=1e-3, z=1.5)
    evals, _, gammas, lambdas = directional_samples(1, noise=0.3)
    damping = policy(evals, None, gammas, lambdas)
    coefficients = newton_coefficients(gammas.mean(0), lambdas.mean(0), damping)
    for k in range(NUM_DIRECTIONS):
        g, lam = gammas[:, k].tolist(), lambdas[:, k].tolist()
        n, m = len(g), len(lam)
        g_mean, lam_mean = sum(g) / n, sum(lam) / m
        g_se = math.sqrt(sum((x - g_mean) ** 2 for x in g) / (n - 1) / n)
        lam_se = math.sqrt(sum((x - lam_mean) ** 2 for x in lam) / (m - 1) / m)
        slope = max(abs(g_mean) - 1.5 * g_se, 0.0)
        expected = -math.copysign(slope, g_mean) / (lam_mean + 1.5 * lam_se + 1e-3)
        assert coefficients[k].item() == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_noise_aware_drops_directions_lost_in_noise():
    evals, _, gammas, lambdas = directional_samples(2, noise=1.0)
    damping = NoiseAwareDamping(base=0.0, z=3.0)(evals, None, gammas, lambdas)
    # direction 2 has mean slope 0.05 ≪ 3 standard errors (≈ 0.75)
    assert math.isinf(damping[2])
    coefficients = newton_coefficients(gammas.mean(0), lambdas.mean(0), damping)
    assert coefficients[2] == 0
    assert torch.isfinite(damping[3])


def test_gsnr_damping_formula():
    evals, _, gammas, lambdas = directional_samples(3, noise=0.5)
    damping = GSNRDamping(base=1e-3)(evals, None, gammas, lambdas)
    batch = gammas.shape[0]
    for k in range(NUM_DIRECTIONS):
        g = gammas[:, k]
        variance = ((g - g.mean()) ** 2).sum() / (batch - 1)
        signal = g.mean() ** 2 - variance / batch
        if signal <= 0:
            assert math.isinf(damping[k])
        else:
            expected = 1e-3 + lambdas[:, k].mean() * variance / (batch * signal)
            assert damping[k].item() == pytest.approx(expected.item(), rel=1e-12)


def test_gsnr_damping_drops_pure_noise():
    generator = torch.Generator().manual_seed(4)
    gammas = torch.randn(64, 200, generator=generator, dtype=torch.float64)
    lambdas = torch.ones(64, 200, dtype=torch.float64)
    damping = GSNRDamping()(lambdas.mean(0), None, gammas, lambdas)
    # Pure noise: the debiased signal is ≤ 0 about half the time, and where it is
    # positive the damping dominates the curvature by far (median over directions).
    dropped = torch.isinf(damping).double().mean()
    assert 0.35 < dropped < 0.75
    assert damping[torch.isfinite(damping)].median() > 1.0


@pytest.mark.parametrize(
    ("ratio", "expected"),
    [(0.1, 1.5), (-2.0, 1.5), (0.5, 1.0), (0.9, 2 / 3), (float("nan"), 1.0)],
    ids=["too-optimistic", "loss-increased", "neutral", "good-model", "no-prediction"],
)
def test_levenberg_marquardt_rule(ratio, expected):
    policy = LevenbergMarquardt(value=1.0)
    policy.update(ratio)
    assert policy.value == pytest.approx(expected)


def test_levenberg_marquardt_bounds_and_interval():
    policy = LevenbergMarquardt(value=1.0, minimum=0.5, maximum=2.0, interval=2)
    for _ in range(10):
        policy.update(0.0)
    assert policy.value == 2.0 and policy.updates == 10
    policy.update(1.0)  # 11th update: not on the interval
    assert policy.value == 2.0
    policy.update(1.0)
    assert policy.value == pytest.approx(4 / 3)


@pytest.mark.parametrize(
    "policy",
    [
        ConstantDamping(0.1),
        RelativeDamping(0.05),
        NoiseAwareDamping(1e-3, 2.0),
        GSNRDamping(1e-2),
        LevenbergMarquardt(value=0.3, updates=7),
    ],
    ids=lambda p: type(p).__name__,
)
def test_policies_round_trip(policy):
    assert pickle.loads(pickle.dumps(policy)) == policy
    buffer = io.BytesIO()
    torch.save({"damping": policy}, buffer)
    buffer.seek(0)
    # Explicit: weights_only=True is torch.load's default only from torch 2.6 on.
    assert torch.load(buffer, weights_only=True)["damping"] == policy


@pytest.mark.parametrize(
    ("make", "error"),
    [
        (lambda: ConstantDamping(-1.0), ValueError),
        (lambda: ConstantDamping(float("nan")), ValueError),
        (lambda: RelativeDamping(-0.1), ValueError),
        (lambda: NoiseAwareDamping(z=-1.0), ValueError),
        (lambda: GSNRDamping(base=-1.0), ValueError),
        (lambda: LevenbergMarquardt(decrease=1.5), ValueError),
        (lambda: LevenbergMarquardt(value=10.0, maximum=1.0), ValueError),
        (lambda: as_damping("large"), TypeError),
        (lambda: as_damping(-0.1), ValueError),
        (lambda: ConstantDamping("0.1"), TypeError),
        (lambda: ConstantDamping(True), TypeError),
        (lambda: RelativeDamping(None), TypeError),
        (lambda: LevenbergMarquardt(value="1"), TypeError),
        (lambda: LevenbergMarquardt(interval=2.5), TypeError),
        (lambda: LevenbergMarquardt(updates=-3), ValueError),
    ],
    ids=[
        "negative",
        "nan",
        "negative-fraction",
        "negative-z",
        "negative-base",
        "decrease>1",
        "value>max",
        "string",
        "negative-shorthand",
        "string-value",
        "bool-value",
        "none-fraction",
        "lm-string-value",
        "lm-float-interval",
        "lm-negative-updates",
    ],
)
def test_invalid_settings(make, error):
    with pytest.raises(error, match=r"must be|needs|Damping"):
        make()


@pytest.mark.parametrize(
    ("policy", "field"),
    [
        (ConstantDamping(0.1), "value"),
        (RelativeDamping(0.05), "fraction"),
        (NoiseAwareDamping(1e-3, 2.0), "z"),
        (GSNRDamping(1e-2), "base"),
    ],
    ids=lambda p: type(p).__name__ if not isinstance(p, str) else p,
)
def test_stateless_policies_cannot_be_changed_after_their_check(policy, field):
    """The optimizer trusts a constant's value: a later assignment must not get in."""
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(policy, field, -5.0)


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("interval", 0, ValueError),
        ("interval", 2.5, TypeError),
        ("decrease", 3.0, ValueError),
        ("increase", 0.5, ValueError),
        ("minimum", 5.0, ValueError),
        ("maximum", -1.0, ValueError),
        ("updates", -1, ValueError),
    ],
)
def test_levenberg_marquardt_checks_every_assigned_field(field, value, error):
    """As at construction: the step trusts the fields (interval=0 divided by zero)."""
    policy = LevenbergMarquardt(value=0.3, interval=2)
    before = dataclasses.asdict(policy)
    with pytest.raises(error, match=field):
        setattr(policy, field, value)
    assert dataclasses.asdict(policy) == before


def test_levenberg_marquardt_adapts_within_its_bounds():
    """The adapted value is clipped before it is set (never out of its bounds)."""
    policy = LevenbergMarquardt(value=1.0, maximum=1.2)
    policy.update(0.0)
    assert policy.value == 1.2
    policy = LevenbergMarquardt(value=1.0, minimum=0.9)
    policy.update(1.0)
    assert policy.value == 0.9


@pytest.mark.parametrize("value", [-5.0, math.nan, math.inf])
def test_levenberg_marquardt_checks_an_assigned_value(value):
    policy = LevenbergMarquardt(value=0.3)
    with pytest.raises(ValueError, match="Damping must be finite and >= 0"):
        policy.value = value
    assert policy.value == 0.3
    policy.value = 0.5  # a valid value is set
    assert policy.value == 0.5


def test_relative_damping_is_a_fraction_of_the_largest_eigenvalue():
    evals, _, gammas, lambdas = directional_samples(0, noise=0.1)
    damping = RelativeDamping(0.2)(evals, None, gammas, lambdas)
    assert_close(damping, torch.full_like(evals, 0.2 * evals.max().item()))
    # Scale-free: scaling the curvature scales the damping, so c_k scales by 1/scale.
    scaled = RelativeDamping(0.2)(10 * evals, None, gammas, 10 * lambdas)
    assert_close(scaled, 10 * damping)
    empty = torch.zeros(0, dtype=torch.float64)
    assert RelativeDamping(0.2)(empty, None, gammas[:, :0], lambdas[:, :0]).numel() == 0


def test_checked_damping_rejects_bad_policy_output():
    with pytest.raises(ValueError, match="shape"):
        checked_damping(torch.ones(3), 2)
    with pytest.raises(ValueError, match=">= 0"):
        checked_damping(torch.tensor([1.0, -1.0]), 2)
    with pytest.raises(ValueError, match=">= 0"):
        checked_damping(torch.tensor([1.0, float("nan")]), 2)
    assert torch.isinf(checked_damping(torch.tensor([1.0, float("inf")]), 2)[1])


def test_policy_kinds_are_declared_by_type_not_by_attributes():
    """Mean-statistics and adaptive policies are known by their base and protocol."""

    def per_sample(evals, gram_evecs, gammas, lambdas):
        return torch.zeros_like(evals)

    assert isinstance(per_sample, Damping)
    assert needs_sample_statistics(as_damping(per_sample))
    assert not needs_sample_statistics(as_damping(0.1))
    for policy in (ConstantDamping(0.1), RelativeDamping(0.1), LevenbergMarquardt()):
        assert isinstance(policy, MeanStatisticsDamping)
    for policy in (NoiseAwareDamping(), GSNRDamping()):
        assert needs_sample_statistics(policy)
    assert isinstance(LevenbergMarquardt(), AdaptiveDamping)
    assert not isinstance(ConstantDamping(0.1), AdaptiveDamping)


def test_policy_sources_have_no_control_characters():
    """LaTeX in docstrings stays LaTeX: no form feed or backspace bytes."""
    for module in (damping_module, criteria_module, complement_module):
        source = inspect.getsource(module)
        assert "\f" not in source
        assert "\b" not in source
