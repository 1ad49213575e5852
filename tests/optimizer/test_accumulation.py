"""Gradient accumulation: a closure's micro-batches give the step of their batch.

Each closure back-propagates every micro-batch's mean loss times a weight ``w_m``.
With ``w_m = N_m/N`` (or ``1/M`` for equal sizes) the steps are those of one closure
on the concatenated batch; with ``1/M`` for unequal sizes they are those of the
batch whose per-sample losses are weighted ``1/(M N_m)``, which the reference
realizes by repeating micro-batch ``m`` ``L/N_m`` times (``L = lcm(N_m)``). With
Monte-Carlo curvature, each micro-batch draws its labels from the optimizer's
generator in turn: the reference draws each micro-batch's labels the same way (once
per micro-batch, repeated with its rows).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from unittest import mock

import pytest
import torch
from backpack import extend
from torch import Tensor

from dampednewton import CurvatureAveraging, DampedNewton, GramBasis, LevenbergMarquardt
from dampednewton.diagnostics import GSNR, DiagnosticsMonitor
from dampednewton.math.sampling import sampled_cross_entropy_gradients
from tests.cases import case_by_id
from tests.utils import Case, build_case

MLP, CNN = "mlp-sigmoid-ce-n6", "cnn-nopool-ce-n6"  # N = 6 samples each
STEPS = 3
EVEN = [(3, 3), (2, 2, 2)]
UNEVEN = [(2, 4), (1, 2, 3)]


def _optimizer(case: Case, mc_samples: int, **options) -> DampedNewton:
    """Every default (averaging, complement, trust region) and adapted damping."""
    settings = {
        "basis": GramBasis(),
        "damping": LevenbergMarquardt(0.1, interval=1),
        "criterion": 5,
        "momentum": 0.5,
        "mc_samples": mc_samples,
        "seed": 0,
        **options,
    }
    return DampedNewton(case.model.parameters(), **settings)


def _parts(sizes: Sequence[int]) -> list[Tensor]:
    return list(torch.arange(sum(sizes)).split(list(sizes)))


def _accumulating_closure(
    case: Case, optimizer: DampedNewton, sizes: Sequence[int], weights: Sequence[float]
) -> Callable[[], Tensor]:
    """Zero once; per micro-batch forward, then backward of its weighted mean loss."""

    def closure() -> Tensor:
        optimizer.zero_grad()
        total = torch.zeros((), dtype=case.X.dtype)
        for rows, weight in zip(_parts(sizes), weights, strict=True):
            loss = case.loss_fn(case.model(case.X[rows]), case.y[rows]) * weight
            loss.backward()
            total = total + loss.detach()
        return total

    return closure


def _single_closure(
    case: Case, optimizer: DampedNewton, rows: Tensor, scale: float = 1.0
) -> Callable[[], Tensor]:
    def closure() -> Tensor:
        optimizer.zero_grad()
        loss = case.loss_fn(case.model(case.X[rows]), case.y[rows]) * scale
        loss.backward()
        return loss

    return closure


def _draws_per_micro_batch(
    sizes: Sequence[int], repeats: Sequence[int]
) -> Callable[..., Tensor]:
    """The reference's Monte-Carlo gradients: each micro-batch's rows draw in turn.

    The reference batch holds micro-batch ``m`` ``repeats[m]`` times in a row; its
    copies share the first copy's draws.
    """

    def draws(logits: Tensor, mc_samples: int, generator=None) -> Tensor:
        blocks = logits.split([n * r for n, r in zip(sizes, repeats, strict=True)])
        drawn = []
        for block, size, repeat in zip(blocks, sizes, repeats, strict=True):
            once = sampled_cross_entropy_gradients(block[:size], mc_samples, generator)
            drawn.extend([once] * repeat)
        return torch.cat(drawn, dim=1)

    return draws


def _assert_same_steps(
    sizes: Sequence[int],
    weights: Sequence[float],
    repeats: Sequence[int],
    problem: str,
    mc_samples: int,
    **options,
) -> None:
    """The accumulating closure's parameters and losses equal the reference's."""
    case, twin = build_case(case_by_id(problem)), build_case(case_by_id(problem))
    optimizer = _optimizer(case, mc_samples, **options)
    reference = _optimizer(twin, mc_samples, **options)
    rows = torch.cat(
        [part.repeat(r) for part, r in zip(_parts(sizes), repeats, strict=True)]
    )
    closure = _accumulating_closure(case, optimizer, sizes, weights)
    reference_closure = _single_closure(twin, reference, rows)
    for step in range(STEPS):
        loss = optimizer.step(closure)
        with mock.patch(
            "dampednewton.backpack.loss_derivatives.sampled_cross_entropy_gradients",
            _draws_per_micro_batch(sizes, repeats),
        ):
            expected_loss = reference.step(reference_closure)
        torch.testing.assert_close(loss, expected_loss, rtol=1e-10, atol=1e-12)
        for param, expected in zip(
            case.model.parameters(), twin.model.parameters(), strict=True
        ):
            torch.testing.assert_close(
                param, expected, rtol=1e-10, atol=1e-12, msg=f"step {step}"
            )
    assert optimizer.records["global"]["step"] == STEPS


@pytest.mark.parametrize("mc_samples", [0, 1], ids=["exact", "mc"])
@pytest.mark.parametrize("problem", [MLP, CNN])
@pytest.mark.parametrize("sizes", EVEN + UNEVEN, ids=str)
def test_micro_batches_give_the_step_of_the_concatenated_batch(
    sizes, problem, mc_samples
):
    # Equal sizes with 1/M (accumulation loops, Lightning), unequal ones with N_m/N.
    even = len(set(sizes)) == 1
    total = sum(sizes)
    weights = [1 / len(sizes) if even else n / total for n in sizes]
    _assert_same_steps(sizes, weights, [1] * len(sizes), problem, mc_samples)


@pytest.mark.parametrize("mc_samples", [0, 1], ids=["exact", "mc"])
@pytest.mark.parametrize("problem", [MLP, CNN])
@pytest.mark.parametrize("sizes", UNEVEN, ids=str)
def test_uneven_micro_batches_over_m_weight_their_samples_by_one_over_m_n_m(
    sizes, problem, mc_samples
):
    # Σ_m L_m / M: sample n of micro-batch m has weight 1/(M N_m), as in a batch
    # holding micro-batch m lcm/N_m times.
    common = math.lcm(*sizes)
    repeats = [common // n for n in sizes]
    weights = [1 / len(sizes)] * len(sizes)
    _assert_same_steps(sizes, weights, repeats, problem, mc_samples)


def test_micro_batches_between_refreshes_of_the_averaged_curvature():
    # Step 1 reuses the averaged factor: a plain backward pass that reads .grad only.
    sizes = (1, 2, 3)
    weights = [n / 6 for n in sizes]
    averaging = CurvatureAveraging(interval=2)
    _assert_same_steps(sizes, weights, [1, 1, 1], MLP, 0, averaging=averaging)


def test_weights_that_do_not_sum_to_one_step_as_a_scaled_loss_with_a_warning():
    # Forgetting the 1/M: .grad is M times the mean gradient, as for one backward
    # pass of M times the batch's loss, which steps the same, with BackPACK's warning.
    case, twin = build_case(case_by_id(MLP)), build_case(case_by_id(MLP))
    optimizer, reference = _optimizer(case, 0), _optimizer(twin, 0)
    sizes = (3, 3)
    closure = _accumulating_closure(case, optimizer, sizes, [1.0, 1.0])
    reference_closure = _single_closure(twin, reference, torch.arange(6), scale=2.0)

    with pytest.warns(UserWarning, match=r"2 micro-batches .* do not sum to 1.*N_m"):
        optimizer.step(closure)
    with pytest.warns(UserWarning, match="seems to have been modified"):
        reference.step(reference_closure)

    for param, expected in zip(
        case.model.parameters(), twin.model.parameters(), strict=True
    ):
        torch.testing.assert_close(param, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("key", ["subsampling_ggn", "subsampling_grad"])
def test_subsampling_with_micro_batches_is_refused(key):
    case = build_case(case_by_id(MLP))
    # subsampling_grad serves ViViT's step, without averaging.
    averaging = {"averaging": None} if key == "subsampling_grad" else {}
    optimizer = _optimizer(case, 0, **{key: [0, 1]}, **averaging)
    closure = _accumulating_closure(case, optimizer, (3, 3), [0.5, 0.5])
    before = [p.detach().clone() for p in case.model.parameters()]

    with pytest.raises(ValueError, match="subsampling_ggn=None and subsampling_grad"):
        optimizer.step(closure)

    for param, value in zip(case.model.parameters(), before, strict=True):
        assert torch.equal(param, value)


def test_micro_batches_at_a_step_of_the_monitor_are_refused():
    case = build_case(case_by_id(MLP))
    optimizer = _optimizer(case, 0, monitor=DiagnosticsMonitor([GSNR()]))
    closure = _accumulating_closure(case, optimizer, (3, 3), [0.5, 0.5])

    with pytest.raises(RuntimeError, match=r"2 backward passes .* monitor is active"):
        optimizer.step(closure)


def test_each_micro_batch_frees_the_activations_the_step_does_not_keep():
    # The first layer's output (the sigmoid's input) is neither a layer input nor a
    # square root: alive until its micro-batch's backward pass, freed after it.
    case = build_case(case_by_id(MLP))
    optimizer = _optimizer(case, 0, damping=0.1)  # no second call of the closure
    outputs: list[weakref.ref] = []
    case.model[0].register_forward_hook(
        lambda module, inputs, output: outputs.append(weakref.ref(output))
    )
    alive: list[tuple[bool, bool]] = []

    def closure() -> Tensor:
        optimizer.zero_grad()
        total = torch.zeros((), dtype=case.X.dtype)
        for rows in _parts((3, 3)):
            loss = case.loss_fn(case.model(case.X[rows]), case.y[rows]) / 2
            before = outputs[-1]() is not None
            loss.backward()
            total = total + loss.detach()
            del loss
            alive.append((before, outputs[-1]() is not None))
        return total

    optimizer.step(closure)

    assert alive == [(True, False), (True, False)]


@pytest.mark.parametrize(
    ("basis", "match"),
    [
        (None, r"of the closure's 2 backward passes, 1 reached a layer of shape"),
        (GramBasis(), r"Micro-batch 2 of the closure reached other parameters"),
    ],
    ids=["kronecker", "gram"],
)
def test_losses_of_heads_back_propagated_one_by_one_are_refused(basis, match):
    """Two heads of a trunk, each with its loss, one backward pass each: refused.

    On the same samples a head's curvature would be its own loss's undiluted (half
    its step, measured), so both bases refuse; parameters and state unchanged.
    """
    torch.manual_seed(0)
    trunk = extend(torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh()))
    heads = [extend(torch.nn.Linear(5, 3)), extend(torch.nn.Linear(5, 2))]
    losses = [extend(torch.nn.CrossEntropyLoss()), extend(torch.nn.MSELoss())]
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(8, 4, generator=generator)
    targets = [torch.randint(0, 3, (8,), generator=generator), torch.randn(8, 2)]
    modules = [trunk, *heads]
    params = [p for module in modules for p in module.parameters()]
    options = {} if basis is None else {"basis": basis}
    optimizer = DampedNewton(params, seed=0, **options)

    def closure() -> Tensor:
        optimizer.zero_grad()
        total = torch.zeros(())
        for head, loss_fn, y in zip(heads, losses, targets, strict=True):
            loss = loss_fn(head(trunk(X)), y) / 2
            loss.backward()
            total = total + loss.detach()
        return total

    values = [p.detach().clone() for p in params]
    with pytest.raises(RuntimeError, match=match):
        optimizer.step(closure)
    assert all(torch.equal(p, v) for p, v in zip(params, values, strict=True))
    assert all(not entry for entry in optimizer.state.values())
