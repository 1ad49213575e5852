"""LR schedulers drive the groups' lr, and the step scales with it."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from torch.optim import Optimizer
from torch.optim.lr_scheduler import CosineAnnealingLR, LRScheduler, OneCycleLR, StepLR

from dampednewton import DampedNewton
from tests.assertions import assert_close
from tests.cases import PROBLEMS
from tests.utils import (
    EXACT_VIVIT_STEP,
    build_case,
    copy_parameters,
    flat,
    layer_groups,
    make_closure,
    reference_step,
)

MLP_CE = PROBLEMS[0]
BASE_LRS = (1.0, 0.5)
NUM_STEPS = 5
DAMPING, NUM_DIRECTIONS = 0.5, 2


@dataclass(frozen=True)
class Schedule:
    """A scheduler and the closed form of the lr it sets after ``t`` of its steps."""

    id: str
    scheduler: Callable[[Optimizer], LRScheduler]
    lr: Callable[[float, int], float]


SCHEDULES = [
    Schedule(
        "StepLR",
        lambda optimizer: StepLR(optimizer, step_size=2, gamma=0.5),
        lambda base, t: base * 0.5 ** (t // 2),
    ),
    Schedule(
        "CosineAnnealingLR",
        lambda optimizer: CosineAnnealingLR(optimizer, T_max=4, eta_min=0.05),
        lambda base, t: 0.05 + (base - 0.05) * (1 + math.cos(math.pi * t / 4)) / 2,
    ),
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: s.id)
def test_scheduler_sets_group_lr_and_step_scales(schedule: Schedule):
    case = build_case(MLP_CE)
    layers = layer_groups(case.model)
    optimizer = DampedNewton(
        [
            {"params": params, "lr": lr}
            for params, lr in zip(layers, BASE_LRS, strict=True)
        ],
        damping=DAMPING,
        criterion=NUM_DIRECTIONS,
        **EXACT_VIVIT_STEP,
    )
    scheduler = schedule.scheduler(optimizer)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    reference_layers = layer_groups(case.reference_model)
    for t in range(NUM_STEPS):
        copy_parameters(case.reference_model, case.model)
        expected_steps = [
            reference_step(
                case.reference_model,
                case.reference_loss_fn,
                params,
                case.X,
                case.y,
                NUM_DIRECTIONS,
                DAMPING,
            ).step
            for params in reference_layers
        ]
        before = [flat(params) for params in layers]

        optimizer.step(closure)
        scheduler.step()

        for index, (group, base) in enumerate(
            zip(optimizer.param_groups, BASE_LRS, strict=True)
        ):
            lr = schedule.lr(base, t)
            expected = lr * expected_steps[index]
            assert_close(
                flat(group["params"]) - before[index],
                expected,
                rtol=1e-7,
                atol=1e-10 * expected.abs().max().item(),
                name=f"step {t}, group {index}: lr {lr:g} × reference step",
            )
            assert group["lr"] == pytest.approx(schedule.lr(base, t + 1), rel=1e-12)
            assert group["initial_lr"] == base


def test_a_schedule_scales_the_defaults_steps_where_the_trust_region_binds():
    """Halving the lr halves the defaults' update, also where the trust region binds.

    The trust region bounds the step before the learning rate (with K-FAC's ``lr²``
    inside the bound the learning rate would cancel there). Twin runs from the same
    state: the second step after ``StepLR`` halved the lr against one without it.
    """
    updates = []
    for schedule in (False, True):
        case = build_case(MLP_CE)
        optimizer = DampedNewton(case.model.parameters(), seed=0)
        scheduler = StepLR(optimizer, step_size=1, gamma=0.5)
        closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
        optimizer.step(closure)
        if schedule:
            scheduler.step()
        before = flat(list(case.model.parameters()))
        optimizer.step(closure)
        updates.append(flat(list(case.model.parameters())) - before)
        assert optimizer.param_groups[0]["lr"] == (0.5 if schedule else 1.0)
        assert optimizer.records["groups"][0]["trust_region_scale"] < 1
    assert_close(
        updates[1],
        0.5 * updates[0],
        rtol=0,
        atol=1e-12 * updates[0].abs().max().item(),
        name="update at lr 0.5 against half the update at lr 1",
    )


def test_groups_carry_the_keys_torch_and_its_schedulers_write():
    """``param_names`` (an optimizer of named parameters) and OneCycleLR's keys."""
    case = build_case(MLP_CE)
    first, *_, last = layer_groups(case.model)
    optimizer = DampedNewton([(f"first.{i}", p) for i, p in enumerate(first)])
    OneCycleLR(optimizer, max_lr=1.0, total_steps=10, cycle_momentum=False)
    copied = dict(optimizer.param_groups[0])
    copied.update(params=list(last), param_names=["last.0", "last.1"])
    optimizer.add_param_group(copied)
    assert optimizer.param_groups[1]["param_names"] == ["last.0", "last.1"]
    assert optimizer.param_groups[1]["max_lr"] == 1.0
