"""The optimizer's group step composed over the same engine as ViViT's classes."""

import torch
from backpack import extend

from dampednewton import DampedNewton
from dampednewton._step.group_step import StepFinisher
from dampednewton._step.options import GroupOptions
from dampednewton._step.step_block import STEP_BLOCK, StepBlock
from dampednewton.backpack.passes import backward_pass
from dampednewton.computations import DirectionalDampedNewtonComputation
from dampednewton.computations.engine import GGNEngine, GGNSettings


def _problem():
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = extend(
        torch.nn.Sequential(
            torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3)
        ).double()
    )
    loss_fn = extend(torch.nn.CrossEntropyLoss())
    inputs = torch.randn(6, 5, generator=generator, dtype=torch.float64)
    targets = torch.randint(3, (6,), generator=generator)
    return model, loss_fn, inputs, targets


def _plain_block(params):
    """A block with ViViT's step only: ``k = 3``, ``δ = 0.5``, ``φ = 1``."""
    optimizer = DampedNewton(
        params,
        damping=0.5,
        criterion=3,
        complement=None,
        newton_fraction=1.0,
        averaging=None,
    )
    group = optimizer.param_groups[0]
    return StepBlock(tuple(group["params"]), GroupOptions.from_group(group))


def _run(model, loss_fn, inputs, targets, extensions, hook):
    model.zero_grad()
    with backward_pass(extensions, [hook]):
        loss_fn(model(inputs), targets).backward()


def test_finisher_without_complement_or_averaging_gives_exactly_vivit_step():
    model, loss_fn, inputs, targets = _problem()
    group = {"params": list(model.parameters()), "criterion": 3, "damping": 0.5}
    vivit = DirectionalDampedNewtonComputation(warn_small_eigvals=0)
    _run(
        model,
        loss_fn,
        inputs,
        targets,
        vivit.get_extensions(),
        vivit.get_extension_hook([group]),
    )
    expected = vivit.get_details(group)

    finisher = StepFinisher(per_sample_gradients=True, subsampling_grad=None)
    engine = GGNEngine(
        GGNSettings(),
        finisher,
        required_group_keys=(STEP_BLOCK,),
        keeps_factors=True,
        needs_gradients=True,
        defers_finish=True,
    )
    block = _plain_block(group["params"]).engine_group()
    _run(model, loss_fn, inputs, targets, engine.extensions(), engine.hook([block]))
    actual = engine.result(block)

    assert actual is not None and finisher.eigensolver_succeeded
    assert bool(actual.curvature_finite)
    # The fixed-size top-k tail holds ViViT's selection last, marked as selected.
    first = actual.evals.numel() - int(actual.selected.sum())
    for name in ("evals", "gamma_mean", "lambda_mean", "damping", "coefficients"):
        mine = getattr(actual, name)[first:]
        assert torch.equal(mine, getattr(expected, name)), name
    for mine, theirs in zip(actual.direction, expected.step, strict=True):
        assert torch.equal(mine, theirs)
    torch.testing.assert_close(
        actual.slope, torch.sum(expected.gamma_mean * expected.coefficients)
    )


def test_finisher_flags_a_non_finite_curvature_without_reading_it():
    model, loss_fn, inputs, targets = _problem()
    finisher = StepFinisher(per_sample_gradients=True, subsampling_grad=None)
    engine = GGNEngine(
        GGNSettings(),
        finisher,
        keeps_factors=True,
        needs_gradients=True,
        defers_finish=True,
    )
    block = _plain_block(list(model.parameters())).engine_group()
    bad_inputs = inputs.clone()
    bad_inputs[0, 0] = torch.inf
    _run(model, loss_fn, bad_inputs, targets, engine.extensions(), engine.hook([block]))
    result = engine.result(block)
    # The zeroed Gram matrix reached the eigensolver; the flag refuses the step.
    assert result is not None and finisher.eigensolver_succeeded
    assert not bool(result.curvature_finite)
