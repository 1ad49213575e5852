"""Momentum, weight decay and the trust region vs a twin optimizer without them.

The reference is the parameter update of a twin optimizer without the piece and the
explicit GGN at the same parameters, compared in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dampednewton import DampedNewton
from tests import reference
from tests.assertions import assert_close
from tests.cases import PROBLEMS
from tests.utils import build_case, copy_parameters, flat, make_closure

PROBLEM = {problem.id: problem for problem in PROBLEMS}


TOLERANCE = 1e-9
"""Relative to the largest entry: float64 round-off, amplified over a few steps."""


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
        "momentum": 0.0,
        "weight_decay": 0.0,
    }
    optimizer = DampedNewton(params, **{**common, **settings})
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
    """``ν = min(1, √(2κ / max(−ḡᵀs, sᵀGs)))`` scales ``lr·s`` (explicit G)."""
    lr = 0.7
    records = twin_steps("cnn-ce", 3, lr=lr, kl_clip=kl_clip)
    scales = []
    for index, (update, step, gradient, _, G) in enumerate(records):
        damped_curvature = -(gradient @ step)
        assert damped_curvature > 0, "the step must be a descent direction"
        curvature = torch.maximum(damped_curvature, step @ G @ step)
        scale = min(1.0, (2 * kl_clip / curvature).sqrt().item())
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
