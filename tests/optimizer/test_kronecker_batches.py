"""Layers of one shape stepped together: the same steps as layer by layer.

The batched step's math is checked against a dense solve in
``tests/test_kronecker_math.py``; here the optimizer's batched steps (the deep MLP's
two hidden ``Linear(4, 4)`` share a batch) are compared with its layer-by-layer
steps, one param group per layer. The first step of every Kronecker problem, this one
included, is checked against the exact GGN's K-FAC step in ``test_kronecker_step.py``,
and its noise filter against dense moments in ``test_noise_filter.py``.
"""

from __future__ import annotations

import pytest
import torch
from backpack import extend
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.micro.step_profile import EigensolverCalls, computes
from dampednewton import (
    CurvatureAveraging,
    DampedNewton,
    KroneckerBasis,
    NoiseFilter,
)
from dampednewton._step import kronecker, kronecker_refresh
from dampednewton._step.kronecker_group import layer_batches
from dampednewton._step.kronecker_state import stored_bases
from tests.cases import case_by_id
from tests.utils import (
    Case,
    assert_same_parameters,
    build_case,
    layer_groups,
    make_closure,
    train_twins,
)

BASES = {
    "exact": {},
    "truncated": {"rank": 2, "exact_size": 0},
    "mixed": {"rank": 3, "exact_size": 4},
}


def deep_mlp() -> Case:
    return build_case(case_by_id("deep-mlp-ce"))


def test_layers_of_one_shape_share_a_batch():
    case = deep_mlp()
    optimizer = DampedNewton(case.model.parameters())
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    params = list(case.model.parameters())
    bases = stored_bases(optimizer.state, optimizer.records["groups"][0], params)
    assert bases is not None
    batches = layer_batches(bases)
    assert [len(batch.layers) for batch in batches] == [1, 2, 1]
    middle = batches[1]
    assert middle.stacked and middle.output.vectors.shape == (2, 4, 4)
    assert middle.inputs.vectors.shape == (2, 5, 5)


def test_a_batch_computes_its_curvature_coefficients_when_first_asked():
    case = deep_mlp()
    optimizer = DampedNewton(
        case.model.parameters(), basis=KroneckerBasis(rank=2, exact_size=0)
    )
    optimizer.step(make_closure(optimizer, case.model, case.loss_fn, case.X, case.y))
    params = list(case.model.parameters())
    bases = stored_bases(optimizer.state, optimizer.records["groups"][0], params)
    assert bases is not None
    batch = layer_batches(bases)[1]
    lean = batch.coefficients(0.01, with_curvature=False)
    assert lean.curvatures is None and lean.both_curvature is None
    assert batch.coefficients(0.01, with_curvature=False) is lean
    full = batch.coefficients(0.01, with_curvature=True)
    assert full.curvatures is not None and full.both_curvature is not None
    assert torch.equal(full.core, lean.core)
    # Coefficients with curvatures serve a step without; a new damping recomputes.
    assert batch.coefficients(0.01, with_curvature=False) is full
    assert batch.coefficients(0.02, with_curvature=False).curvatures is None


def batched_and_layer_by_layer(**settings) -> list[tuple[DampedNewton, Case]]:
    """The deep MLP twice: one group (batched) and one group per layer.

    Refreshes at steps 0, 1, 3, 5, …; without a trust region (which bounds each
    group's step) both take the same steps.
    """
    batched, alone = deep_mlp(), deep_mlp()
    settings = {
        "averaging": CurvatureAveraging(interval=2),
        "damping": 0.1,  # 1e-2 without a trust region lets the weights grow 400-fold
        "kl_clip": None,
        "seed": 0,
        **settings,
    }
    return [
        (DampedNewton(batched.model.parameters(), **settings), batched),
        (
            DampedNewton(
                [{"params": group} for group in layer_groups(alone.model)],
                **settings,
            ),
            alone,
        ),
    ]


@pytest.mark.parametrize("noise_filter", [None, NoiseFilter(0.9, 0.8, floor=0.1)])
@pytest.mark.parametrize("basis", list(BASES.values()), ids=list(BASES))
def test_batched_steps_are_the_layer_by_layer_steps(basis, noise_filter):
    """Refreshes and steps between them, the noise filter's moments included.

    14 steps refresh 8 times: the eigenvectors recomputed on the first six,
    Rayleigh quotients on the last two.
    """
    runs = batched_and_layer_by_layer(
        basis=KroneckerBasis(**basis, noise_filter=noise_filter)
    )
    train_twins(runs, steps=14)
    (optimizer, batched), (reference, alone) = runs
    assert optimizer.records["groups"][0]["curvature_updates"] == 8
    # Batched and single products round differently.
    assert_same_parameters(batched.model, alone.model, rtol=1e-12, atol=1e-13)
    if noise_filter is not None:
        for first, second in zip(
            batched.model.parameters(), alone.model.parameters(), strict=True
        ):
            for key, value in optimizer.state[first].items():
                if key.startswith("noise_filter"):
                    expected = reference.state[second][key]
                    assert value.shape == expected.shape, key
                    torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-14)


def test_a_layer_unfrozen_between_refreshes_joins_its_batch():
    """A layer of one shape without stored factors is refreshed alone, then batched.

    The deep MLP's second hidden layer is frozen for the first refreshes: at the
    refresh after it thaws, its batch mixes a layer with stored factors and one
    without, as one param group per layer does it.
    """
    runs = batched_and_layer_by_layer()
    for optimizer, case in runs:
        thawing = [m for m in case.model if isinstance(m, torch.nn.Linear)][2]
        thawing.requires_grad_(False)
        train_twins([(optimizer, case)], steps=4)
        assert "kronecker_input_factor" not in optimizer.state[thawing.weight]
        thawing.requires_grad_(True)
        train_twins([(optimizer, case)], steps=6)
        assert "kronecker_input_factor" in optimizer.state[thawing.weight]
    assert_same_parameters(runs[0][1].model, runs[1][1].model, rtol=1e-12, atol=1e-13)


def operators_of_refreshes(hidden: int, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Operators of each refresh's own math (averages, eigenpairs), 8 refreshes.

    The tanh MLP of :func:`operators_between_refreshes`, refreshed on every step:
    the eigenvectors recomputed on the first six refreshes (from a fixed start on
    the first), Rayleigh quotients on the last two.
    """
    counts: list[int] = []
    refresh = kronecker_refresh.refreshed_layers  # unwrapped by any earlier patch

    def counted(*args, **kwargs):
        with ComputingOperators() as operators:
            result = refresh(*args, **kwargs)
        counts.append(operators.count)
        return result

    monkeypatch.setattr(kronecker, "refreshed_layers", counted)
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(10, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (10,), generator=generator)
    layers = [torch.nn.Linear(6, 8), torch.nn.Tanh()]
    for _ in range(hidden):
        layers += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
    model = extend(torch.nn.Sequential(*layers, torch.nn.Linear(8, 3)).double())
    optimizer = DampedNewton(
        model.parameters(),
        # Truncated factors (subspace iterations); rotations on refreshes 0-5 only.
        basis=KroneckerBasis(rank=4, exact_size=4, rotation_interval=3),
        averaging=CurvatureAveraging(interval=1, ramp=False),
    )
    closure = make_closure(optimizer, model, extend(torch.nn.CrossEntropyLoss()), X, y)
    for _ in range(8):
        optimizer.step(closure)
    return counts


def test_refreshes_do_not_grow_with_layers_of_one_shape(monkeypatch):
    """Two hidden layers of one shape or six: a refresh's math costs the same."""
    shallow = operators_of_refreshes(2, monkeypatch)
    deep = operators_of_refreshes(6, monkeypatch)
    assert len(shallow) == 8 and shallow == deep, (shallow, deep)
    assert shallow[-1] < shallow[-3], shallow  # Rayleigh quotients are cheaper


def test_switching_the_noise_filter_on_between_refreshes():
    """Moments start at the step the filter is switched on, one per layer."""
    case = deep_mlp()
    optimizer = DampedNewton(
        case.model.parameters(),
        averaging=CurvatureAveraging(interval=10, ramp=False),
    )
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    (group,) = optimizer.param_groups
    for basis in (KroneckerBasis(), KroneckerBasis(noise_filter=NoiseFilter())):
        group["basis"] = basis
        optimizer.step(closure)  # a refresh, then a step between refreshes
    layers = [m for m in case.model if isinstance(m, torch.nn.Linear)]
    for layer in layers:
        entry = optimizer.state[layer.weight]
        rows = entry["kronecker_output_values"].shape[0]
        columns = entry["kronecker_input_values"].shape[0]
        assert entry["noise_filter_first_moment"].shape == (rows, columns)
        assert entry["noise_filter_first_weight"] == pytest.approx(0.05, rel=1e-12)


class ComputingOperators(TorchDispatchMode):
    """Counts the ATen operators that compute (the launch-budget benchmark's rule)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if computes(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


def operators_between_refreshes(hidden: int, basis: KroneckerBasis) -> tuple[int, int]:
    """Operators of a step between refreshes, and of its plain forward and backward.

    A tanh MLP 6-8-…-8-3 with ``hidden`` layers ``Linear(8, 8)`` of one shape.
    """
    generator = torch.Generator().manual_seed(0)
    X = torch.randn(10, 6, generator=generator, dtype=torch.float64)
    y = torch.randint(0, 3, (10,), generator=generator)

    def mlp() -> torch.nn.Sequential:
        torch.manual_seed(0)
        layers = [torch.nn.Linear(6, 8), torch.nn.Tanh()]
        for _ in range(hidden):
            layers += [torch.nn.Linear(8, 8), torch.nn.Tanh()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(8, 3)).double()

    model, loss_fn = extend(mlp()), extend(torch.nn.CrossEntropyLoss())
    optimizer = DampedNewton(
        model.parameters(),
        basis=basis,
        averaging=CurvatureAveraging(interval=100, ramp=False),
    )
    closure = make_closure(optimizer, model, loss_fn, X, y)
    for _ in range(3):  # a refresh, then steps between refreshes (buffers made)
        optimizer.step(closure)
    plain, plain_loss = mlp(), torch.nn.CrossEntropyLoss()

    def forward_backward() -> None:
        plain.zero_grad()
        plain_loss(plain(X), y).backward()

    counts = []
    for step in (lambda: optimizer.step(closure), forward_backward):
        with ComputingOperators() as operators:
            step()
        counts.append(operators.count)
    return counts[0], counts[1]


def test_operators_between_refreshes_do_not_grow_with_layers_of_one_shape():
    """Two hidden layers of one shape or six: the step adds no operator of its own."""
    shallow, plain_shallow = operators_between_refreshes(2, KroneckerBasis())
    deep, plain_deep = operators_between_refreshes(6, KroneckerBasis())
    assert deep - shallow == plain_deep - plain_shallow, (shallow, deep)
    filtered = KroneckerBasis(noise_filter=NoiseFilter())
    alone, _ = operators_between_refreshes(2, filtered)
    more, _ = operators_between_refreshes(6, filtered)
    assert more - alone == plain_deep - plain_shallow, (alone, more)


@pytest.mark.parametrize("basis", BASES)
def test_a_rotating_refresh_solves_one_eigenproblem_batch_per_size(basis: str):
    """Every layer's eigenproblems of one size in one ``eigh`` (a GPU sync each)."""
    case = deep_mlp()
    policy = KroneckerBasis(**BASES[basis])
    optimizer = DampedNewton(case.model.parameters(), basis=policy)
    closure = make_closure(optimizer, case.model, case.loss_fn, case.X, case.y)
    with EigensolverCalls() as solves:
        optimizer.step(closure)  # the first refresh rotates
    layers = [m for m in case.model if isinstance(m, torch.nn.Linear)]
    dims = {layer.out_features for layer in layers} | {
        layer.in_features + 1 for layer in layers
    }
    assert solves.count == len({policy.kept(dim) for dim in dims}) < 2 * len(layers)
