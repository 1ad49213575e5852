"""Schedule-Free averaging (``momentum=ScheduleFree(...)``) against a reference.

The reference steps a twin optimizer without momentum and keeps Schedule-Free's three
sequences explicitly in float64: the fast iterate ``z`` takes each step ``Δ`` (the
twin's move of the parameters ``y``), the average ``x ← (1 − c_t) x + c_t z``, and
``y = (1 − β) z + β x`` is written back. The optimizer keeps only ``z`` and moves
``y`` by the update derived from these.
"""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from dampednewton import DampedNewton, GramBasis, ScheduleFree
from dampednewton._step.options import GroupOptions
from dampednewton._step.update import (
    AVERAGED_STEPS,
    FAST_ITERATE,
    schedule_free_update,
    update_parameter,
    update_parameters,
)
from tests.cases import KRONECKER_PROBLEMS, case_by_id
from tests.utils import build_case, make_closure

POLICY = ScheduleFree(interpolation=0.8, recency=3.0)


class ExplicitScheduleFree:
    """``z``, ``x`` and ``y`` of Schedule-Free, each stored (the brute-force rule)."""

    def __init__(self, params: list[Tensor], policy: ScheduleFree) -> None:
        self.params, self.policy = params, policy
        self.fast = [p.detach().clone() for p in params]
        self.average = [p.detach().clone() for p in params]
        self.steps = 0

    def step(self, optimizer: DampedNewton, closure) -> None:
        """Take the twin's step at ``y``, then average and interpolate."""
        before = [p.detach().clone() for p in self.params]
        optimizer.step(closure)
        self.steps += 1
        weight = self.policy.weight(self.steps)
        beta = self.policy.interpolation
        with torch.no_grad():
            for param, start, fast, average in zip(
                self.params, before, self.fast, self.average, strict=True
            ):
                fast += param - start
                average.mul_(1 - weight).add_(fast, alpha=weight)
                param.copy_((1 - beta) * fast + beta * average)


def test_the_policy_weighs_recent_iterates_and_refuses_bad_settings():
    assert [ScheduleFree(recency=1).weight(t) for t in (1, 3)] == [0.5, 0.25]
    assert [POLICY.weight(t) for t in (1, 2, 5)] == [1.0, 1.0, 0.5]
    for bad in (1.0, -0.1):
        with pytest.raises(ValueError, match="0 <= interpolation < 1"):
            ScheduleFree(interpolation=bad)
    for bad in (0.5, math.inf):
        with pytest.raises(ValueError, match="recency >= 1"):
            ScheduleFree(recency=bad)
    with pytest.raises(TypeError, match="must be a number"):
        ScheduleFree(recency="4")  # type: ignore[arg-type]


def test_the_update_keeps_y_between_the_explicit_iterate_and_average():
    generator = torch.Generator().manual_seed(0)
    start = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    fast, average, param = start.clone(), start.clone(), start.clone()
    stored_fast = start.clone()
    for step in range(1, 8):
        update = torch.randn(5, 3, generator=generator, dtype=torch.float64)
        weight = POLICY.weight(step)
        fast += update
        average = (1 - weight) * average + weight * fast
        schedule_free_update(param, stored_fast, update, POLICY.interpolation, weight)
        expected = (1 - POLICY.interpolation) * fast + POLICY.interpolation * average
        torch.testing.assert_close(param, expected, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(stored_fast, fast, rtol=0, atol=0)


SETTINGS = {
    "kronecker": {},
    "lr-and-decay": {"lr": 0.5, "weight_decay": 1e-2},
}
RUNS = [
    pytest.param(problem, settings, id=f"{problem.id}-{name}")
    for problem in KRONECKER_PROBLEMS
    for name, settings in SETTINGS.items()
] + [
    pytest.param(
        case_by_id("mlp-relu-ce-n8"),
        {"basis": GramBasis(), "weight_decay": 1e-2},
        id="mlp-relu-ce-n8-gram",
    )
]


@pytest.mark.parametrize("problem, settings", RUNS)
def test_steps_equal_the_explicit_reference(problem, settings):
    assert_matches_reference(problem, settings, "cpu")


@pytest.mark.cuda
def test_packed_and_graphed_steps_equal_the_explicit_reference():
    """On a CUDA device the defaults step packed, replayed as CUDA graphs."""
    assert_matches_reference(case_by_id("cnn-ce"), {}, "cuda")


def assert_matches_reference(problem, settings: dict[str, Any], device: str) -> None:
    """Twelve steps with ``POLICY`` equal the explicit sequences of a plain twin."""
    case = build_case(problem, torch.float64, device)
    twin = build_case(problem, torch.float64, device)
    optimizer = DampedNewton(
        case.model.parameters(), momentum=POLICY, kl_clip=1e-2, seed=0, **settings
    )
    plain = DampedNewton(
        twin.model.parameters(), momentum=0.0, kl_clip=1e-2, seed=0, **settings
    )
    reference = ExplicitScheduleFree(list(twin.model.parameters()), POLICY)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    twin_closure = make_closure(plain, twin.model, twin.loss_fn, twin.X, twin.y)
    for _ in range(12):
        optimizer.step(closure)
        reference.step(plain, twin_closure)
    for actual, expected, fast in zip(
        case.model.parameters(), twin.model.parameters(), reference.fast, strict=True
    ):
        torch.testing.assert_close(actual, expected, rtol=1e-9, atol=1e-11)
        stored = optimizer.state[actual]
        torch.testing.assert_close(stored[FAST_ITERATE], fast, rtol=1e-9, atol=1e-11)
        assert stored[AVERAGED_STEPS].item() == 12


def test_parameters_that_missed_steps_average_with_their_own_weights():
    """The multi-tensor update groups parameters by their counts of steps."""
    generator = torch.Generator().manual_seed(1)
    group: dict[str, Any] = {
        "lr": 0.7,
        "weight_decay": 0.1,
        "momentum": POLICY,
        "nesterov": False,
    }
    options = GroupOptions.from_group(
        DampedNewton([torch.zeros(1, requires_grad=True)], **group).param_groups[0]
    )
    params = [
        torch.randn(4, 2, generator=generator, dtype=torch.float64).requires_grad_()
        for _ in range(3)
    ]
    for param in params:
        param.grad = torch.zeros_like(param)
    twins = [p.detach().clone() for p in params]
    state: dict = {p: {} for p in params}
    twin_state: dict = {i: {} for i in range(3)}
    for step in range(4):
        directions = [
            torch.randn(p.shape, generator=generator, dtype=torch.float64)
            for p in params
        ]
        moving = [0, 1, 2] if step % 2 == 0 else [0, 2]  # the second misses steps
        with torch.no_grad():
            update_parameters(
                [(params[i], directions[i]) for i in moving], state, options, 0.3
            )
            for i in moving:
                update_parameter(twins[i], directions[i] * 0.3, twin_state[i], options)
    assert state[params[1]][AVERAGED_STEPS].item() == 2
    for param, twin in zip(params, twins, strict=True):
        torch.testing.assert_close(param.detach(), twin, rtol=1e-14, atol=1e-14)


def _model_and_closure(dtype: torch.dtype = torch.float64):
    case = build_case(case_by_id("mlp-ce"), dtype)
    optimizer = DampedNewton(case.model.parameters(), momentum=POLICY, seed=0)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    return case, optimizer, closure


def test_a_checkpoint_resumes_the_same_steps():
    case, optimizer, closure = _model_and_closure()
    for _ in range(4):
        optimizer.step(closure)
    buffer = io.BytesIO()
    torch.save(
        {"model": case.model.state_dict(), "optimizer": optimizer.state_dict()}, buffer
    )
    for _ in range(3):
        optimizer.step(closure)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed, again, resumed_closure = _model_and_closure()
    resumed.model.load_state_dict(saved["model"])
    again.load_state_dict(saved["optimizer"])
    assert again.param_groups[0]["momentum"] == POLICY
    for param in resumed.model.parameters():
        count = again.state[param][AVERAGED_STEPS]  # torch's loader leaves "step"
        assert (count.dtype, count.device.type, count.item()) == (torch.int64, "cpu", 4)
    for _ in range(3):
        again.step(resumed_closure)
    for actual, expected in zip(
        resumed.model.parameters(), case.model.parameters(), strict=True
    ):
        assert torch.equal(actual, expected)


def test_a_refused_step_leaves_the_iterate_and_its_count():
    case, optimizer, closure = _model_and_closure()
    for _ in range(3):
        optimizer.step(closure)
    kept = {
        p: {key: value.clone() for key, value in optimizer.state[p].items()}
        for p in optimizer.state
    }
    params = [p.detach().clone() for p in case.model.parameters()]

    def nan_closure():
        optimizer.zero_grad()
        loss = case.loss_fn(case.model(case.X), case.y) * math.nan
        loss.backward()
        return loss

    with pytest.raises(FloatingPointError):
        optimizer.step(nan_closure)
    for param, before in zip(case.model.parameters(), params, strict=True):
        assert torch.equal(param, before)
        for key in (FAST_ITERATE, AVERAGED_STEPS):
            assert torch.equal(optimizer.state[param][key], kept[param][key])


def test_a_bfloat16_model_keeps_its_iterate_in_float32():
    case, optimizer, closure = _model_and_closure(torch.bfloat16)
    first = optimizer.step(closure)
    for _ in range(5):
        last = optimizer.step(closure)
    assert last < first
    for param in case.model.parameters():
        assert param.dtype == torch.bfloat16
        assert optimizer.state[param][FAST_ITERATE].dtype == torch.float32
    _, loaded, _ = _model_and_closure(torch.bfloat16)
    loaded.load_state_dict(optimizer.state_dict())
    for param in loaded.state:
        assert loaded.state[param][FAST_ITERATE].dtype == torch.float32


def test_wrong_settings_say_what_to_do():
    param = nn.Parameter(torch.zeros(2))
    with pytest.raises(ValueError, match="not ScheduleFree"):
        DampedNewton([param], momentum=POLICY, nesterov=True)
    with pytest.raises(ValueError, match=r"\[0, 1\) or a ScheduleFree"):
        DampedNewton([param], momentum=1.5)


def test_a_state_of_another_model_is_refused():
    _, optimizer, closure = _model_and_closure()
    optimizer.step(closure)
    saved = optimizer.state_dict()
    first = next(iter(saved["state"]))
    saved["state"][first][FAST_ITERATE] = torch.zeros(7, dtype=torch.float64)
    _, fresh, _ = _model_and_closure()
    with pytest.raises(ValueError, match="shape"):
        fresh.load_state_dict(saved)
