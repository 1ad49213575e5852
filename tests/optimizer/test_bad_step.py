"""A bad step: a clear error, parameters bitwise unchanged, optimizer state unchanged.

Step-time cases run after one good step in Monte-Carlo mode, so that the comparison
of the state dicts also covers the statistics of the last step and the state of the
optimizer's random generator (a refused step must not consume draws).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from backpack import extend
from torch import Tensor, nn
from torch.func import functional_call

from dampednewton import CurvatureAveraging, DampedNewton, GramBasis, KroneckerBasis
from tests.assertions import assert_close
from tests.cases import LINEAR_MSE, PROBLEMS, Problem
from tests.utils import (
    VIVIT_STEP,
    Case,
    assert_parameters_equal,
    assert_same_state,
    build_case,
    make_closure,
    saved_counters,
    snapshot,
)

MLP_CE = PROBLEMS[0]
CLOSURE_REQUIRED = r"(?s)needs a closure.*def closure\(\):.*loss\.backward\(\)"
CALL_EXTEND = r"backpack\.extend\((model|loss_fn)\)"


@dataclass(frozen=True)
class BadStep:
    """A refused ``step``: ``prepare`` returns the call that must raise.

    Attributes:
        id: Readable identifier.
        prepare: Gets the case and the optimizer (after one good step); may change a
            group, and returns the bad call.
        error: Expected exception type.
        match: Regular expression the message must contain.
        problem: Problem the case is built from.
        mc_samples: Monte-Carlo samples of the optimizer (``0``: exact GGN).
    """

    id: str
    prepare: Callable[[Case, DampedNewton], Callable[[], Any]]
    error: type[Exception]
    match: str
    problem: Problem = MLP_CE
    mc_samples: int = 1


def _closure_on(inputs_scale: float = 1.0, nan_at: tuple[int, int] | None = None):
    """A closure on modified inputs (scaled, or with a NaN entry)."""

    def prepare(case: Case, optimizer: DampedNewton) -> Callable[[], Any]:
        X = case.X * inputs_scale
        if nan_at is not None:
            X[nan_at] = math.nan
        return lambda: optimizer.step(
            make_closure(optimizer, case.model, case.loss_fn, X, case.y)
        )

    return prepare


def _plain_model(case: Case, optimizer: DampedNewton) -> Callable[[], Any]:
    """The optimizer's parameters in a forward pass of a model without BackPACK."""
    params = dict(case.model.named_parameters())

    def model(X):
        return functional_call(case.reference_model, params, (X,))

    return lambda: optimizer.step(
        make_closure(optimizer, model, case.loss_fn, case.X, case.y)
    )


def _plain_loss(case: Case, optimizer: DampedNewton) -> Callable[[], Any]:
    loss_fn = case.reference_loss_fn
    return lambda: optimizer.step(
        make_closure(optimizer, case.model, loss_fn, case.X, case.y)
    )


def _sum_loss(case: Case, optimizer: DampedNewton) -> Callable[[], Any]:
    loss_fn = extend(nn.CrossEntropyLoss(reduction="sum"))
    return lambda: optimizer.step(
        make_closure(optimizer, case.model, loss_fn, case.X, case.y)
    )


def _set_in_group(key: str, value: Any, index: int = -1):
    """Change a group's setting directly, as a scheduler would, then step."""

    def prepare(case: Case, optimizer: DampedNewton) -> Callable[[], Any]:
        optimizer.param_groups[index][key] = value
        return _closure_on()(case, optimizer)

    return prepare


def _returns_no_loss(case: Case, optimizer: DampedNewton) -> Callable[[], Any]:
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)

    def no_loss():
        closure()

    return lambda: optimizer.step(no_loss)


def _same_graph_twice(case: Case, optimizer: DampedNewton) -> Callable[[], Any]:
    """Two backward passes of one forward pass: the gradient counted twice."""

    def twice():
        optimizer.zero_grad()
        loss = case.loss_fn(case.model(case.X), case.y)
        loss.backward(retain_graph=True)
        loss.backward()
        return loss

    return lambda: optimizer.step(twice)


def _forwards_before_backwards(
    case: Case, optimizer: DampedNewton
) -> Callable[[], Any]:
    """Both halves' forward passes, then their backward passes.

    BackPACK holds the second forward pass's inputs only.
    """
    half = len(case.X) // 2

    def forwards_first():
        optimizer.zero_grad()
        losses = [
            case.loss_fn(case.model(case.X[part]), case.y[part]) / 2
            for part in (slice(None, half), slice(half, None))
        ]
        for loss in losses:
            loss.backward()
        return sum(losses)

    return lambda: optimizer.step(forwards_first)


def _forwards_then_one_backward(
    case: Case, optimizer: DampedNewton
) -> Callable[[], Any]:
    """Both halves' forward passes, then one backward pass of their mean loss."""
    half = len(case.X) // 2

    def forwards_first():
        optimizer.zero_grad()
        loss = sum(
            case.loss_fn(case.model(case.X[part]), case.y[part]) / 2
            for part in (slice(None, half), slice(half, None))
        )
        loss.backward()
        return loss

    return lambda: optimizer.step(forwards_first)


def _separate_regularizer(case: Case, optimizer: DampedNewton) -> Callable[[], Any]:
    """A second backward pass that never reached the loss module."""

    def with_regularizer():
        optimizer.zero_grad()
        loss = case.loss_fn(case.model(case.X), case.y)
        loss.backward()
        penalty = sum(p.square().sum() for p in case.model.parameters())
        penalty.backward()
        return loss

    return lambda: optimizer.step(with_regularizer)


def _stale_gradients(case: Case, optimizer: DampedNewton) -> Callable[[], Any]:
    """A closure that never zeroes the gradients (after a step that left them)."""

    def without_zero_grad():
        loss = case.loss_fn(case.model(case.X), case.y)
        loss.backward()
        return loss

    return lambda: optimizer.step(without_zero_grad)


def _stale_zero_filled_gradients(
    case: Case, optimizer: DampedNewton
) -> Callable[[], Any]:
    """Stale gradients in tensors that zero_grad(set_to_none=False) would reuse."""
    for param in case.model.parameters():
        param.grad = torch.ones_like(param)
    return _stale_gradients(case, optimizer)


def _subsampling_beyond_the_batch(
    case: Case, optimizer: DampedNewton
) -> Callable[[], Any]:
    """Every group's ``subsampling_ggn`` selects one sample more than the batch has."""
    for group in optimizer.param_groups:
        group["subsampling_ggn"] = list(range(len(case.X) + 1))
    return _closure_on()(case, optimizer)


def _negative_damping(evals, gram_evecs, gammas, lambdas):
    """A damping policy whose values are invalid (checked with the step's reads)."""
    return -torch.ones_like(evals)


DOUBLE_BACKWARD = (
    r"(?s)refused the step: a backward pass reached .* already back-propagated"
    r".*retain_graph.*one forward and one backward pass per micro-batch.*def closure"
)
NOT_THROUGH_LOSS = r"(?s)ran 2 backward passes.*1 of them started at .* loss module"
SEVERAL_LOSSES = (
    r"(?s)(already back-propagated|one backward pass started at 2 losses)"
    r".*one forward and one backward pass per micro-batch"
)
STALE_GRADIENTS = r"(?s)held values from before.*optimizer\.zero_grad\(\)"

NONFINITE_CASES = [
    BadStep(
        "nan-input",
        _closure_on(nan_at=(0, 0)),
        FloatingPointError,
        "the loss is nan",
        mc_samples=0,
    ),
    BadStep(
        "inf-input",
        _closure_on(math.inf),
        FloatingPointError,
        "the loss is (nan|inf)",
        mc_samples=0,
    ),
    BadStep(
        "overflowing-ggn",
        _closure_on(1e200),
        FloatingPointError,
        r"step is not finite \(the GGN is not finite",
    ),
    # Finite loss and GGN; the products of gradients and GGN factors overflow.
    BadStep(
        "overflowing-step",
        _closure_on(1e110),
        FloatingPointError,
        "step is not finite",
        problem=LINEAR_MSE,
        mc_samples=0,
    ),
]
STEP_CASES = [
    BadStep("no-closure", lambda case, opt: opt.step, RuntimeError, CLOSURE_REQUIRED),
    BadStep("model-not-extended", _plain_model, RuntimeError, CALL_EXTEND),
    BadStep("loss-not-extended", _plain_loss, RuntimeError, CALL_EXTEND),
    BadStep("reduction-sum", _sum_loss, ValueError, "reduction='sum'"),
    *NONFINITE_CASES,
    BadStep("closure-without-loss", _returns_no_loss, TypeError, "return the loss"),
    BadStep("same-graph-twice", _same_graph_twice, RuntimeError, DOUBLE_BACKWARD),
    BadStep(
        "forwards-before-backwards",
        _forwards_before_backwards,
        RuntimeError,
        DOUBLE_BACKWARD,
    ),
    BadStep(
        "forwards-then-one-backward",
        _forwards_then_one_backward,
        RuntimeError,
        SEVERAL_LOSSES,
    ),
    BadStep(
        "separate-regularizer", _separate_regularizer, RuntimeError, NOT_THROUGH_LOSS
    ),
    BadStep("stale-gradients", _stale_gradients, RuntimeError, STALE_GRADIENTS),
    BadStep(
        "stale-zero-filled-gradients",
        _stale_zero_filled_gradients,
        RuntimeError,
        STALE_GRADIENTS,
    ),
    BadStep("lr-set-negative", _set_in_group("lr", -1.0), ValueError, "learning rate"),
    BadStep("damping-set-negative", _set_in_group("damping", -1.0), ValueError, ">= 0"),
    BadStep(
        "damping-policy-negative",
        _set_in_group("damping", _negative_damping),
        ValueError,
        "invalid values",
    ),
    BadStep("criterion-set-0", _set_in_group("criterion", 0), ValueError, "k >= 1"),
    BadStep(
        "subsampling-beyond-the-batch",
        _subsampling_beyond_the_batch,
        IndexError,
        r"select sample (\d+), but this batch has \1 samples\. .*subsampling_ggn=",
    ),
    BadStep(
        "mc-samples-set-in-one-group",
        _set_in_group("mc_samples", 2),
        ValueError,
        "'mc_samples' must be the same",
    ),
]


def test_nan_input_in_monte_carlo_mode_is_a_nonfinite_step():
    bad = BadStep("nan-input-mc", _closure_on(nan_at=(0, 0)), FloatingPointError, "")
    case, optimizer = _optimizer_after_one_step(bad)
    with pytest.raises(FloatingPointError, match="the loss is nan"):
        bad.prepare(case, optimizer)()


def _optimizer_after_one_step(
    bad: BadStep, nonfinite: str = "raise"
) -> tuple[Case, DampedNewton]:
    case = build_case(bad.problem)
    first, *rest = (p for layer in case.model.children() for p in layer.parameters())
    optimizer = DampedNewton(
        [{"params": [first]}, {"params": rest, "lr": 0.5}],
        damping=1.0,
        criterion=1,
        mc_samples=bad.mc_samples,
        nonfinite=nonfinite,
        seed=0,
        **VIVIT_STEP,
    )
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    return case, optimizer


@pytest.mark.parametrize("bad", STEP_CASES, ids=lambda bad: bad.id)
def test_refused_step_changes_nothing(bad: BadStep):
    case, optimizer = _optimizer_after_one_step(bad)
    call = bad.prepare(case, optimizer)
    params = list(case.model.parameters())
    values = [p.detach().clone() for p in params]
    before = snapshot(optimizer)

    with pytest.raises(bad.error, match=bad.match):
        call()

    assert_parameters_equal(params, values)
    assert_same_state(snapshot(optimizer), before)


@pytest.mark.parametrize("bad", NONFINITE_CASES, ids=lambda bad: bad.id)
def test_nonfinite_step_is_skipped_with_a_warning(bad: BadStep):
    case, optimizer = _optimizer_after_one_step(bad, nonfinite="skip")
    call = bad.prepare(case, optimizer)
    params = list(case.model.parameters())
    values = [p.detach().clone() for p in params]
    expected = snapshot(optimizer)
    saved_counters(expected)["skipped_steps"] += 1

    with pytest.warns(RuntimeWarning, match="refused the update: .*" + bad.match) as w:
        loss = call()

    assert isinstance(loss, torch.Tensor) and loss.shape == ()
    refusals = [r for r in w if "refused" in str(r.message)]
    assert [Path(r.filename) for r in refusals] == [Path(__file__)], (
        "the warning must point at the caller of step()"
    )
    assert_parameters_equal(params, values)
    assert_same_state(snapshot(optimizer), expected)


WITHOUT_BACKPACK = {
    "between-refreshes": CurvatureAveraging(interval=2, ramp=False),
    "autograd-refresh": CurvatureAveraging(interval=2),
}
"""The second step without BackPACK's hooks: between refreshes (at 0, 2, 4, …), or a
refresh through ``torch.autograd.grad`` (the ramp's, at 0, 1, 3, …)."""


@pytest.mark.parametrize("averaging", WITHOUT_BACKPACK.values(), ids=WITHOUT_BACKPACK)
@pytest.mark.parametrize(
    ("prepare", "match"),
    [
        (_same_graph_twice, DOUBLE_BACKWARD),
        (_forwards_then_one_backward, SEVERAL_LOSSES),
        (_separate_regularizer, NOT_THROUGH_LOSS),
        (_stale_gradients, STALE_GRADIENTS),
    ],
    ids=[
        "same-graph-twice",
        "forwards-then-one-backward",
        "separate-regularizer",
        "stale-gradients",
    ],
)
def test_bad_backward_is_refused_on_steps_without_backpack(
    prepare, match: str, averaging: CurvatureAveraging
):
    """Without BackPACK's hooks the step reads ``.grad`` and the losses' forwards."""
    case = build_case(MLP_CE)
    optimizer = DampedNewton(case.model.parameters(), averaging=averaging, seed=0)
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    call = prepare(case, optimizer)
    params = list(case.model.parameters())
    values = [p.detach().clone() for p in params]
    before = snapshot(optimizer)

    with pytest.raises(RuntimeError, match=match):
        call()

    assert_parameters_equal(params, values)
    assert_same_state(snapshot(optimizer), before)
    good = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    optimizer.step(good)  # the refusal left no hook behind
    assert optimizer.records["global"]["step"] == 2


def test_forwards_before_backwards_are_refused_by_backpacks_pass():
    """BackPACK holds the second forward pass's inputs only: its pass refuses them."""
    case = build_case(MLP_CE)
    optimizer = DampedNewton(case.model.parameters(), seed=0)
    params = list(case.model.parameters())
    values = [p.detach().clone() for p in params]
    before = snapshot(optimizer)

    with pytest.raises(RuntimeError, match=DOUBLE_BACKWARD):
        _forwards_before_backwards(case, optimizer)()

    assert_parameters_equal(params, values)
    assert_same_state(snapshot(optimizer), before)


@pytest.mark.parametrize("averaging", WITHOUT_BACKPACK.values(), ids=WITHOUT_BACKPACK)
def test_forwards_before_backwards_step_as_micro_batches_without_backpack(
    averaging: CurvatureAveraging,
):
    """Their mean gradient is right, and so are the autograd pass's factors.

    Between refreshes the step reads the gradient only; the autograd refresh takes
    each micro-batch's factors at its loss's forward pass. Both take the steps of
    the same micro-batches run forward, then backward, in turn.
    """
    runs = [build_case(MLP_CE) for _ in range(2)]
    optimizers = [
        DampedNewton(run.model.parameters(), averaging=averaging, seed=0)
        for run in runs
    ]
    half = len(runs[0].X) // 2
    parts = (slice(None, half), slice(half, None))

    def in_turn() -> Tensor:
        optimizers[1].zero_grad()
        total = torch.zeros(())
        for part in parts:
            loss = runs[1].loss_fn(runs[1].model(runs[1].X[part]), runs[1].y[part])
            (loss / 2).backward()
            total = total + loss.detach() / 2
        return total

    for run, optimizer in zip(runs, optimizers, strict=True):
        optimizer.step(make_closure(optimizer, run.model, run.loss_fn, run.X, run.y))
    forwards_first = _forwards_before_backwards(runs[0], optimizers[0])
    for _ in range(4):  # between refreshes and refreshes (autograd's)
        forwards_first()
        optimizers[1].step(in_turn)
    for actual, expected in zip(
        runs[0].model.parameters(), runs[1].model.parameters(), strict=True
    ):
        assert_close(actual, expected)
    assert optimizers[0]._pipeline.kronecker._passes.autograd


def test_the_kronecker_basis_refuses_a_subsample_beyond_the_batch():
    """The default basis' refresh: the same error, nothing changed."""
    case = build_case(MLP_CE)
    optimizer = DampedNewton(case.model.parameters(), seed=0)
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    call = _subsampling_beyond_the_batch(case, optimizer)
    params = list(case.model.parameters())
    values = [p.detach().clone() for p in params]
    before = snapshot(optimizer)

    with pytest.raises(IndexError, match=r"select sample \d+, .*subsampling_ggn="):
        call()

    assert_parameters_equal(params, values)
    assert_same_state(snapshot(optimizer), before)


@pytest.mark.parametrize("basis", [KroneckerBasis(), GramBasis()], ids=repr)
def test_forwards_then_one_backward_is_refused_between_refreshes(basis):
    """Without BackPACK's hooks the loss modules count the losses of the pass."""
    case = build_case(MLP_CE)
    optimizer = DampedNewton(case.model.parameters(), basis=basis, seed=0)
    for _ in range(2):  # both bases refresh at steps 0, 1, 3
        optimizer.step(
            make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
        )
    call = _forwards_then_one_backward(case, optimizer)
    params = list(case.model.parameters())
    values = [p.detach().clone() for p in params]
    before = snapshot(optimizer)

    with pytest.raises(RuntimeError, match="one backward pass started at 2 losses"):
        call()

    assert_parameters_equal(params, values)
    assert_same_state(snapshot(optimizer), before)
