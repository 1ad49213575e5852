"""Momentum, weight decay and the trust region vs a twin optimizer without them.

The reference is the parameter update of a twin optimizer without the piece and the
explicit GGN at the same parameters, compared in float64.
"""

from __future__ import annotations

import pytest
import torch
from backpack import extend
from torch import Tensor

from dampednewton import DampedNewton, GramBasis
from dampednewton._step.quadratic_model import trust_region_scale
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


@pytest.mark.parametrize(
    ("slope", "batch_curvature"),
    [(0.0, None), (0.0, 0.0), (-0.0, 0.0), (0.0, -0.0), (-1e-300, None)],
)
def test_a_step_of_zero_slope_has_trust_region_scale_one(slope, batch_curvature):
    """ν = min(1, √(2κ / max(−ḡᵀs, sᵀĜs))); a zero model curvature (also −0) is 1."""
    batch = None if batch_curvature is None else torch.tensor(batch_curvature)
    scale = trust_region_scale(torch.tensor(slope), batch, kl_clip=1e-3)
    assert torch.equal(torch.as_tensor(scale), torch.tensor(1.0))


@pytest.mark.filterwarnings("ignore:The criterion of parameter group 0")
def test_a_group_whose_step_is_zero_stays_where_it_was():
    """A layer behind a zero read-out must not move, nor turn NaN.

    It gets no gradient and no curvature (Gram basis, one group per layer); the
    read-out steps.
    """
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(32, 10, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (32,), generator=gen)
    torch.manual_seed(0)
    model = extend(
        torch.nn.Sequential(
            torch.nn.Linear(10, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)
        ).double()
    )
    torch.nn.init.zeros_(model[2].weight)
    torch.nn.init.zeros_(model[2].bias)
    first = [p.detach().clone() for p in model[0].parameters()]
    optimizer = DampedNewton(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}],
        basis=GramBasis(),
    )
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    optimizer.step(make_closure(optimizer, model, loss_fn, X, y))
    for param, before in zip(model[0].parameters(), first, strict=True):
        assert torch.equal(param, before)  # the Gram basis decays no weights
    assert optimizer.records["groups"][0]["trust_region_scale"] == 1.0
    assert model[2].weight.abs().sum() > 0
