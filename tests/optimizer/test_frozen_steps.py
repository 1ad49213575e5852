"""Steps between curvature refreshes: one plain backward pass, a frozen basis.

The float64 comparison with the explicit moving average of the GGN (frozen steps
included) is in ``test_curvature_averaging.py``; here: the lean path equals the
general pipeline, BackPACK's hooks are off in between and back afterwards, refused
and failed steps change nothing, and a resume between refreshes is bit-identical.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from backpack import hook_run_extensions

from dampednewton import CurvatureAveraging, DampedNewton, GramBasis
from dampednewton.diagnostics import GSNR, DiagnosticsMonitor, EveryKSteps
from tests.cases import PROBLEMS
from tests.utils import build_case, flat, make_closure

PROBLEM = {problem.id: problem for problem in PROBLEMS}
INTERVAL = 3
STEPS = 7


def make_optimizer(params, **options) -> DampedNewton:
    settings = {
        "basis": GramBasis(),
        "criterion": 3,
        "lr": 0.5,
        "damping": 0.3,
        "averaging": CurvatureAveraging(decay=0.7, interval=INTERVAL, ramp=False),
        "warn_small_eigvals": 0,
        "seed": 1,
    }
    settings.update(options)
    return DampedNewton(params, **settings)


@pytest.mark.parametrize("problem_id", ["mlp-ce", "cnn-ce"])
@pytest.mark.parametrize(
    "options",
    [{}, {"momentum": 0.9, "weight_decay": 0.01}, {"kl_clip": None}],
    ids=["plain", "momentum-decay", "no-trust-region"],
)
def test_lean_path_equals_the_general_pipeline(problem_id, options):
    """A monitor active on every step sends frozen steps through the general path.

    Its parameters after refreshes and frozen steps equal those of the lean path.
    """
    lean, general = build_case(PROBLEM[problem_id]), build_case(PROBLEM[problem_id])
    general.model.load_state_dict(lean.model.state_dict())
    monitor = DiagnosticsMonitor([GSNR(EveryKSteps(1))])
    optimizers = [
        make_optimizer(lean.model.parameters(), **options),
        make_optimizer(general.model.parameters(), monitor=monitor, **options),
    ]
    closures = [
        make_closure(opt, case.model, case.loss_fn, case.X, case.y)
        for opt, case in zip(optimizers, (lean, general), strict=True)
    ]
    for step in range(STEPS):
        for optimizer, closure in zip(optimizers, closures, strict=True):
            optimizer.step(closure)
        torch.testing.assert_close(
            flat(general.model.parameters()),
            flat(lean.model.parameters()),
            rtol=0,
            atol=1e-14,
            msg=lambda text, step=step: f"step {step}: {text}",
        )
    assert len(monitor.log) == STEPS


def backpack_hooks(model: torch.nn.Module) -> int:
    return sum(
        hook is hook_run_extensions
        for module in model.modules()
        for hook in module._backward_hooks.values()
    )


def test_backpack_hooks_are_off_between_refreshes_and_back_after():
    """In between, the closure runs without BackPACK's hooks; other hooks stay."""
    case = build_case(PROBLEM["mlp-ce"])
    optimizer = make_optimizer(case.model.parameters())
    installed = backpack_hooks(case.model)
    assert installed > 0
    during: list[int] = []
    user_hook_calls: list[int] = []
    first = next(m for m in case.model.modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(lambda *args: user_hook_calls.append(1))
    order = [list(m._forward_hooks.items()) for m in case.model.modules()]

    def closure():
        optimizer.zero_grad()
        loss = case.loss_fn(case.model(case.X), case.y)
        during.append(backpack_hooks(case.model))
        loss.backward()
        return loss

    for _ in range(STEPS):
        optimizer.step(closure)
        assert backpack_hooks(case.model) == installed
    refreshes = [step % INTERVAL == 0 for step in range(STEPS)]
    assert during == [installed if r else 0 for r in refreshes]
    assert len(user_hook_calls) == STEPS
    assert [list(m._forward_hooks.items()) for m in case.model.modules()] == order


def test_refused_and_failed_frozen_steps_change_nothing():
    """A NaN loss (skip and raise) and a raising closure on a frozen step."""
    case = build_case(PROBLEM["mlp-ce"])
    optimizer = make_optimizer(case.model.parameters(), nonfinite="skip")
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    optimizer.step(closure)  # a refresh
    params = flat(case.model.parameters())
    state = copy.deepcopy(optimizer.state_dict())
    bad_inputs = case.X.clone()
    bad_inputs[0] = torch.nan
    bad = make_closure(optimizer, case.model, case.loss_fn, bad_inputs, case.y)

    with pytest.warns(RuntimeWarning, match="refused the update"):
        optimizer.step(bad)
    assert torch.equal(flat(case.model.parameters()), params)
    assert optimizer.records["global"]["skipped_steps"] == 1

    strict = make_optimizer(case.model.parameters())
    strict.load_state_dict(state)
    with pytest.raises(FloatingPointError, match="not finite"):
        strict.step(make_closure(strict, case.model, case.loss_fn, bad_inputs, case.y))
    assert torch.equal(flat(case.model.parameters()), params)

    def failing():
        strict.zero_grad()
        case.loss_fn(case.model(case.X), case.y).backward()
        raise RuntimeError("data loader failed")

    with pytest.raises(RuntimeError, match="data loader failed"):
        strict.step(failing)
    assert torch.equal(flat(case.model.parameters()), params)
    assert backpack_hooks(case.model) > 0
    assert strict.records["global"]["step"] == 1
    strict.step(make_closure(strict, case.model, case.loss_fn, case.X, case.y))
    assert not torch.equal(flat(case.model.parameters()), params)


def test_resume_between_refreshes_is_bit_identical():
    """Save after a frozen step, load into a fresh optimizer, go on: same numbers."""
    reference, resumed = build_case(PROBLEM["mlp-ce"]), build_case(PROBLEM["mlp-ce"])
    resumed.model.load_state_dict(reference.model.state_dict())
    optimizer = make_optimizer(reference.model.parameters(), mc_samples=1)
    closure = make_closure(
        optimizer, reference.model, reference.loss_fn, reference.X, reference.y
    )
    for _ in range(INTERVAL + 1):
        optimizer.step(closure)
    buffer = io.BytesIO()
    torch.save(optimizer.state_dict(), buffer)
    resumed.model.load_state_dict(reference.model.state_dict())
    other = make_optimizer(resumed.model.parameters(), mc_samples=1)
    buffer.seek(0)
    other.load_state_dict(torch.load(buffer, weights_only=True))
    other_closure = make_closure(
        other, resumed.model, resumed.loss_fn, resumed.X, resumed.y
    )
    for _ in range(STEPS):
        optimizer.step(closure)
        other.step(other_closure)
        assert torch.equal(
            flat(resumed.model.parameters()), flat(reference.model.parameters())
        )


@pytest.mark.parametrize("tolerance", [1.0, None])
def test_a_loss_rise_between_refreshes_refreshes_at_the_next_step(tolerance):
    """A frozen step whose loss exceeds twice the refresh's brings the refresh forward.

    The schedule refreshes at steps 0 and 3; the rise adds step 2.
    ``loss_tolerance=None`` keeps the schedule.
    """
    case = build_case(PROBLEM["mlp-ce"])
    averaging = CurvatureAveraging(
        decay=0.7, interval=INTERVAL, ramp=False, loss_tolerance=tolerance
    )
    optimizer = make_optimizer(case.model.parameters(), averaging=averaging)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    shuffled = case.y.roll(1)
    far = make_closure(optimizer, case.model, case.loss_fn, 30 * case.X, shuffled)
    updates = []
    for batch in (closure, far, closure, closure):
        optimizer.step(batch)
        updates.append(optimizer.records["groups"][0]["curvature_updates"])
    assert optimizer.records["global"]["step"] == 4
    assert updates == ([1, 1, 2, 3] if tolerance is not None else [1, 1, 1, 2])
