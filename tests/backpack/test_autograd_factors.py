"""The autograd refresh pass: factors against brute force, steps against BackPACK's.

:class:`~dampednewton.backpack.autograd_factors.AutogradFactors` must give the
factors of the Monte-Carlo GGN that BackPACK's pass gives, from the same draws: the
brute-force reference (:func:`tests.reference.kronecker.kronecker_factors`, one
autograd Jacobian per output) with the draws' outer products in place of the loss
Hessians; and the optimizer must take the same steps with it as with BackPACK's pass.
"""

from __future__ import annotations

import io

import pytest
import torch
from backpack import extend
from torch import Tensor, nn

from dampednewton import CurvatureAveraging, DampedNewton, KroneckerBasis
from dampednewton.backpack.autograd_factors import (
    NOT_COVERED,
    AutogradFactors,
    layer_owned,
)
from dampednewton.backpack.kronecker_hook import LayerFactors
from dampednewton.backpack.loss_checks import DeferredChecks
from dampednewton.backpack.sampled_roots import (
    SAMPLED_LOSSES,
    mean_normalization,
    sampled_gradients,
)
from tests.assertions import assert_close
from tests.cases import KRONECKER_PROBLEMS, Problem, case_by_id
from tests.optimizer.kronecker_twin import layers_of
from tests.reference.kronecker import kronecker_factors
from tests.utils import Case, build_case, make_closure

SAMPLED = [p for p in KRONECKER_PROBLEMS if isinstance(p.loss(), SAMPLED_LOSSES)]


def _sampled_hessians(
    loss: nn.Module,
    outputs: Tensor,
    mc_samples: int,
    seed: int,
    samples: list[int] | None,
) -> Tensor:
    """The pass's draws as per-sample loss Hessians (zero outside ``samples``).

    ``Σ_m g_nm g_nmᵀ / M`` of the draws of the gradient of ``ℓ_n`` summed over the
    outputs, divided by the outputs per sample where the mean is over every entry.
    """
    drawn = outputs if samples is None else outputs[samples]
    generator = torch.Generator(device=outputs.device).manual_seed(seed)
    gradients = sampled_gradients(loss, drawn, mc_samples, generator)
    entries = mean_normalization(loss, outputs) / outputs.shape[0]
    outer = torch.einsum("mnc,mnd->ncd", gradients, gradients) / mc_samples / entries
    if samples is None:
        return outer
    full = outer.new_zeros(outputs.shape[0], *outer.shape[1:])
    full[samples] = outer
    return full


def _one_pass(
    factors: AutogradFactors, loss_fn: nn.Module, outputs: Tensor, targets: Tensor
) -> None:
    """A micro-batch's loss as the closure takes it: forward, then backward.

    The pass's hook sees the forward pass of the extended loss module.
    """
    extend(loss_fn)(outputs, targets).backward()


def _autograd_factors(
    case: Case, mc_samples: int, seed: int, samples: list[int] | None
) -> dict[int, LayerFactors]:
    params = list(case.model.parameters())
    generator = torch.Generator(device=case.X.device).manual_seed(seed)
    factors = AutogradFactors(params, mc_samples, samples, generator, DeferredChecks())
    with factors.collecting():
        _one_pass(factors, case.loss_fn, case.model(case.X), case.y)
    layers = factors.layers()
    assert layers is not None
    return layers


@pytest.mark.parametrize("samples", [None, [0, 2]], ids=["batch", "sub-sample"])
@pytest.mark.parametrize("mc_samples", [1, 3], ids=["mc1", "mc3"])
@pytest.mark.parametrize("problem", SAMPLED, ids=lambda p: p.id)
def test_factors_equal_brute_force_with_the_same_draws(
    problem: Problem, mc_samples: int, samples: list[int] | None, device: str
):
    """``A`` and ``S`` of every layer, float64, from the draws' outer products."""
    case = build_case(problem, device=device)
    factors = _autograd_factors(case, mc_samples, seed=5, samples=samples)
    with torch.no_grad():
        outputs = case.reference_model(case.X)
    hessians = _sampled_hessians(case.loss_fn, outputs, mc_samples, 5, samples)
    layers = layers_of(case.model)
    assert len(factors) == len(layers)
    for layer, reference_layer in zip(
        layers, layers_of(case.reference_model), strict=True
    ):
        inputs, outputs_factor = kronecker_factors(
            case.reference_model,
            case.reference_loss_fn,
            reference_layer,
            case.X,
            case.y,
            samples=samples,
            hessians=hessians,
        )
        found = factors[id(layer.weight)]
        assert found.weight is layer.weight and found.bias is layer.bias
        assert_close(found.mean()[0], inputs)
        assert_close(found.mean()[1], outputs_factor)


def test_micro_batches_enter_with_their_losses_weights():
    """``Σ_m w_m F_m / Σ_m w_m`` with ``w_m`` the gradient that reached loss ``m``."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 3).double()
    loss_fn = extend(nn.CrossEntropyLoss())
    X = torch.randn(6, 4, dtype=torch.float64)
    y = torch.randint(0, 3, (6,))
    parts = [slice(0, 2), slice(2, 6)]
    deferred = DeferredChecks()
    factors = AutogradFactors(list(layer.parameters()), 1, None, None, deferred)
    alone = []
    with factors.collecting():
        for part, weight in zip(parts, (1 / 3, 2 / 3), strict=True):
            outputs = layer(X[part])
            loss = loss_fn(outputs, y[part])  # the pass's hook takes its factors
            alone.append(factors.micro_batches[-1].factors[id(layer.weight)][2:])
            (loss * weight).backward()  # the hook on the loss records the weight
    layers = factors.layers()
    assert layers is not None
    inputs, outputs_factor = layers[id(layer.weight)].mean()
    assert_close(inputs, alone[0][0] / 3 + alone[1][0] * 2 / 3)
    assert_close(outputs_factor, alone[0][1] / 3 + alone[1][1] * 2 / 3)
    assert len(deferred.loss_weights) == 2 and bool(deferred.loss_unscaled)


def test_a_layer_the_loss_does_not_reach_gets_no_factors():
    """As BackPACK's pass: no square root reaches it, so nothing is collected."""
    torch.manual_seed(0)
    used, unused = nn.Linear(4, 3).double(), nn.Linear(4, 2).double()
    X = torch.randn(6, 4, dtype=torch.float64)
    factors = AutogradFactors(
        [*used.parameters(), *unused.parameters()],
        1,
        None,
        torch.Generator().manual_seed(0),
        DeferredChecks(),
    )
    with factors.collecting():
        unused(X)
        _one_pass(
            factors, nn.CrossEntropyLoss(), used(X), torch.zeros(6, dtype=torch.long)
        )
    layers = factors.layers()
    assert layers is not None and list(layers) == [id(used.weight)]


def _run_twice(layer: nn.Module, X: Tensor, factors: AutogradFactors) -> None:
    _one_pass(factors, nn.CrossEntropyLoss(), layer(layer(X)), X[:, 0].long() * 0)


def _another_loss(layer: nn.Module, X: Tensor, factors: AutogradFactors) -> None:
    _one_pass(factors, nn.L1Loss(), layer(X), X)


def _no_backward(layer: nn.Module, X: Tensor, factors: AutogradFactors) -> None:
    extend(nn.CrossEntropyLoss())(layer(X), X[:, 0].long() * 0)


def _different_layers(layer: nn.Module, X: Tensor, factors: AutogradFactors) -> None:
    _one_pass(factors, nn.CrossEntropyLoss(), layer(X), X[:, 0].long() * 0)
    targets = X[:, 0].long() * 0
    _one_pass(factors, nn.CrossEntropyLoss(), X.clone().requires_grad_(), targets)


@pytest.mark.parametrize(
    "run",
    [_run_twice, _another_loss, _no_backward, _different_layers, lambda *a: a[0](a[1])],
    ids=["layer-run-twice", "another-loss", "no-backward", "layers-differ", "no-loss"],
)
def test_what_the_pass_does_not_cover_leaves_it_without_factors(run):
    """The step then keeps its bases and leaves the refresh to BackPACK's pass."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 3).double()
    X = torch.randn(4, 3, dtype=torch.float64)
    factors = AutogradFactors(list(layer.parameters()), 1, None, None, DeferredChecks())
    with factors.collecting():
        run(layer, X, factors)
    assert factors.layers() is None


def test_a_sub_sample_of_several_micro_batches_leaves_it_without_factors():
    """As BackPACK's pass refuses it: the indices select samples of one pass."""
    torch.manual_seed(0)
    layer = nn.Linear(3, 3).double()
    X, y = torch.randn(4, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 0])
    factors = AutogradFactors(list(layer.parameters()), 1, [0], None, DeferredChecks())
    with factors.collecting():
        for part in (slice(0, 2), slice(2, 4)):
            _one_pass(factors, nn.CrossEntropyLoss(), layer(X[part]), y[part])
    assert factors.layers() is None


def test_layer_owned_names_what_the_pass_cannot_serve():
    """Other layers and convolutions it does not unfold hold parameters it needs."""
    linear = nn.Linear(2, 2)
    grouped = nn.Conv1d(2, 2, 1, groups=2)
    norm = nn.LayerNorm(2)
    wanted = {id(p) for m in (linear, grouped, norm) for p in m.parameters()}
    assert layer_owned(linear, wanted) == (linear.weight, linear.bias)
    assert layer_owned(linear, {id(linear.bias)}) == (None, linear.bias)
    assert layer_owned(linear, set()) is None
    assert layer_owned(grouped, wanted) is NOT_COVERED
    assert layer_owned(norm, wanted) is NOT_COVERED


@pytest.mark.parametrize("kind", ["layer-norm", "tied"])
def test_a_collected_parameter_outside_a_covered_layer_leaves_it_without_factors(kind):
    """A LayerNorm's, or one weight in two layers: BackPACK's pass says what to do."""
    torch.manual_seed(0)
    first, second = nn.Linear(3, 3).double(), nn.Linear(3, 3).double()
    middle: nn.Module = nn.LayerNorm(3).double()
    if kind == "tied":
        second.weight = first.weight
        middle = nn.Tanh()
    params = {id(p): p for m in (first, middle, second) for p in m.parameters()}
    factors = AutogradFactors(list(params.values()), 1, None, None, DeferredChecks())
    X = torch.randn(4, 3, dtype=torch.float64)
    with factors.collecting():
        targets = torch.zeros(4, dtype=torch.long)
        _one_pass(factors, nn.CrossEntropyLoss(), second(middle(first(X))), targets)
    assert factors.layers() is None


def _trajectory(
    problem: Problem, autograd: bool, frozen: bool, device: str = "cpu", **options
) -> tuple[Tensor, Tensor]:
    """The parameters before and after nine steps, with or without autograd's pass."""
    case = build_case(problem, device=device)
    start = torch.cat([p.detach().flatten() for p in case.model.parameters()])
    if frozen:  # the first layer's weight: its bias alone is collected
        layers_of(case.model)[0].weight.requires_grad_(False)
    optimizer = DampedNewton(
        case.model.parameters(),
        averaging=CurvatureAveraging(decay=0.5, interval=2),
        seed=0,
        **options,
    )
    optimizer._pipeline.kronecker._passes.autograd = autograd
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    for _ in range(9):  # refreshes at 0 (BackPACK), 1, 3, 5, 7
        optimizer.step(closure)
    assert optimizer._pipeline.kronecker._passes.autograd == autograd
    return start, torch.cat([p.detach().flatten() for p in case.model.parameters()])


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"mc_samples": 2, "subsampling_ggn": [0, 1, 3]},
        {"basis": KroneckerBasis(packed=True)},
    ],
    ids=["defaults", "mc2-sub-sample", "packed"],
)
@pytest.mark.parametrize("frozen", [False, True], ids=["whole", "bias-only"])
@pytest.mark.parametrize("problem", SAMPLED, ids=lambda p: p.id)
def test_steps_equal_those_with_backpacks_pass(
    problem: Problem, frozen: bool, options, device: str
):
    """Nine steps, four of them autograd refreshes, float64: BackPACK's parameters."""
    start, with_autograd = _trajectory(problem, True, frozen, device, **options)
    _, with_backpack = _trajectory(problem, False, frozen, device, **options)
    assert_close(with_autograd, with_backpack)
    assert (with_autograd - start).abs().max() > 1e-3  # they moved


def test_the_default_optimizer_refreshes_through_autograd_after_its_first_step(
    monkeypatch,
):
    """BackPACK's pass at step 0 only, for each sampled loss; the exact GGN's always."""
    calls: list[str] = []
    loss_ran = AutogradFactors.loss_ran

    def counted(self, loss, inputs, output):
        calls.append(type(loss).__name__)
        loss_ran(self, loss, inputs, output)

    monkeypatch.setattr(AutogradFactors, "loss_ran", counted)
    torch.manual_seed(0)
    X, y = torch.randn(32, 5), torch.randint(0, 3, (32,))
    for loss_fn, targets, options, expected in [
        (nn.CrossEntropyLoss(), y, {}, 3),
        (nn.CrossEntropyLoss(), y, {"mc_samples": 0}, 0),
        (nn.MSELoss(), torch.randn(32, 3), {}, 3),
        (nn.BCEWithLogitsLoss(), torch.rand(32, 3), {}, 3),
    ]:
        calls.clear()
        model = extend(nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)))
        optimizer = DampedNewton(model.parameters(), **options)
        closure = make_closure(optimizer, model, extend(loss_fn), X, targets)
        for _ in range(8):  # refreshes at 0 (BackPACK), 1, 3, 7
            optimizer.step(closure)
        assert len(calls) == expected, (loss_fn, options)


def _accumulating(
    case: Case, optimizer: DampedNewton, sizes: tuple[int, ...], total: float = 1.0
):
    """Per micro-batch forward, then backward of its mean loss times ``N_m/N``."""
    parts = torch.arange(sum(sizes)).split(list(sizes))

    def closure() -> Tensor:
        optimizer.zero_grad()
        summed = torch.zeros((), dtype=case.X.dtype)
        for rows in parts:
            weight = total * len(rows) / len(case.X)
            loss = case.loss_fn(case.model(case.X[rows]), case.y[rows]) * weight
            loss.backward()
            summed = summed + loss.detach()
        return summed

    return closure


@pytest.mark.parametrize(
    "first", [(2,), (1,), (1, 1)], ids=["2-rest", "1-rest", "1-1-rest"]
)
@pytest.mark.parametrize("problem_id", ["mlp-ce", "cnn-ce", "mlp-mse"])
def test_micro_batches_step_as_with_backpacks_pass(problem_id: str, first):
    """Gradient accumulation: each micro-batch's factors weighted by its loss's."""
    runs = []
    for autograd in (True, False):
        case = build_case(case_by_id(problem_id))
        sizes = (*first, len(case.X) - sum(first))
        optimizer = DampedNewton(
            case.model.parameters(),
            averaging=CurvatureAveraging(decay=0.5, interval=2),
            seed=0,
        )
        optimizer._pipeline.kronecker._passes.autograd = autograd
        closure = _accumulating(case, optimizer, sizes)
        for _ in range(6):  # refreshes at 0 (BackPACK), 1, 3, 5
            optimizer.step(closure)
        assert optimizer._pipeline.kronecker._passes.autograd == autograd
        runs.append(torch.cat([p.detach().flatten() for p in case.model.parameters()]))
    assert_close(runs[0], runs[1])


def test_micro_batch_weights_that_do_not_sum_to_one_warn_as_in_backpacks_pass():
    case = build_case(case_by_id("mlp-ce"))
    optimizer = DampedNewton(case.model.parameters(), seed=0)
    closure = _accumulating(case, optimizer, (2, 2), total=2.0)
    with pytest.warns(UserWarning, match="micro-batches .* do not sum to 1"):
        optimizer.step(closure)  # BackPACK's pass
    with pytest.warns(UserWarning, match="micro-batches .* do not sum to 1"):
        optimizer.step(closure)  # the autograd pass
    assert optimizer._pipeline.kronecker._passes.autograd


def test_a_resumed_optimizer_refreshes_as_the_one_it_was_saved_from():
    """Its first step after loading is an autograd refresh too: bitwise the same.

    The pass finds its layers as the closure runs them, not from the modules the
    optimizer's earlier BackPACK passes saw (a loaded optimizer saw none).
    """
    runs = [build_case(case_by_id("cnn-ce")) for _ in range(2)]
    optimizers = [DampedNewton(run.model.parameters(), seed=0) for run in runs]
    closures = [
        make_closure(optimizer, run.model, run.loss_fn, run.X, run.y)
        for run, optimizer in zip(runs, optimizers, strict=True)
    ]
    for _ in range(3):  # steps 0, 1, 2: the next, 3, refreshes
        optimizers[0].step(closures[0])
    buffer = io.BytesIO()
    torch.save(optimizers[0].state_dict(), buffer)
    buffer.seek(0)
    with torch.no_grad():
        for target, source in zip(
            runs[1].model.parameters(), runs[0].model.parameters(), strict=True
        ):
            target.copy_(source)
    optimizers[1].load_state_dict(torch.load(buffer, weights_only=True))
    for _ in range(5):  # the refreshes at 3 and 7
        for optimizer, closure in zip(optimizers, closures, strict=True):
            optimizer.step(closure)
        for continued, resumed in zip(
            runs[0].model.parameters(), runs[1].model.parameters(), strict=True
        ):
            assert torch.equal(continued, resumed)
    assert all(o._pipeline.kronecker._passes.autograd for o in optimizers)
