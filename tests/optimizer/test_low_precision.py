"""Half-precision models: curvature and step in float32, the update in their dtype.

The reference is the float64 step of the same weights and inputs (the bfloat16 or
float16 values, exactly representable in float64). The model's own forward and
backward passes round to its dtype (unit round-off ``u = 2⁻⁸`` for bfloat16, ``2⁻¹¹``
for float16), and so does the update. The ``device`` fixture adds CUDA cases.
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
from backpack import extend
from torch import nn

from dampednewton import (
    DampedNewton,
    EigenvalueThreshold,
    GramBasis,
    KroneckerBasis,
    NoiseFilter,
    TopK,
)
from tests.assertions import assert_close
from tests.utils import EXACT_VIVIT_STEP, flat, make_closure, reference_step

HALF = [torch.bfloat16, torch.float16]
"""Unit round-offs ``2⁻⁸`` and ``2⁻¹¹``."""


def _bfloat16_problem(dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    for param in model.parameters():
        with torch.no_grad():
            param.copy_(torch.randn(param.shape, generator=generator))
    inputs = torch.randn(8, 6, generator=generator).to(device, dtype)
    targets = torch.randint(0, 3, (8,), generator=generator).to(device)
    return model.to(device, dtype), inputs, targets


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_half_model_steps_as_the_float64_reference_of_its_weights(dtype, device):
    model, inputs, targets = _bfloat16_problem(dtype, device)
    unit_roundoff = torch.finfo(dtype).eps / 2
    reference_model = copy.deepcopy(model).to(torch.float64)
    before = [p.detach().clone() for p in model.parameters()]
    model, loss_fn = extend(model), extend(nn.CrossEntropyLoss())
    optimizer = DampedNewton(
        model.parameters(), damping=0.5, criterion=2, **EXACT_VIVIT_STEP
    )

    optimizer.step(make_closure(optimizer, model, loss_fn, inputs, targets))

    stats = optimizer.records["groups"][0]
    assert stats["evals"].dtype == torch.float32
    assert all(p.dtype == dtype for p in model.parameters())
    change = flat(
        [(p - b).double() for p, b in zip(model.parameters(), before, strict=True)]
    )
    expected = reference_step(
        reference_model,
        nn.CrossEntropyLoss(),
        list(reference_model.parameters()),
        inputs.double(),
        targets,
        criterion=2,
        damping=0.5,
    )
    # The curvature from half-precision activations: a few round-offs, in float32.
    tolerance = 8 * unit_roundoff
    assert_close(stats["evals"].double(), expected.evals, rtol=tolerance, name="λ")
    assert_close(
        stats["lambda_mean"].double(), expected.lambda_mean, rtol=tolerance, name="λ̄"
    )
    assert_close(  # eigenvectors' signs are arbitrary
        stats["gamma_mean"].double().abs(),
        expected.gamma_mean.abs(),
        rtol=tolerance,
        name="|γ̄|",
    )
    # The step to those round-offs, then θ + s rounded to the model's dtype (u·|θ + s|).
    after = flat([p.double() for p in model.parameters()])
    bound = tolerance * expected.step.abs().max() + unit_roundoff * after.abs()
    assert ((change - expected.step).abs() <= bound).all()


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_half_model_trains(dtype, device):
    """Ten steps on one batch: refreshes 0, 1, 3, 7 and steps along frozen bases."""
    model, inputs, targets = _bfloat16_problem(dtype, device)
    model, loss_fn = extend(model), extend(nn.CrossEntropyLoss())
    optimizer = DampedNewton(model.parameters(), seed=0)
    closure = make_closure(optimizer, model, loss_fn, inputs, targets)
    losses = [optimizer.step(closure).item() for _ in range(10)]
    # No divergence: below the untrained loss. The ratio over seeds 0-9 of this
    # problem: 0.013-0.26, log10 -1.2 ± 0.4 (a fixed factor would sit 2.4 std away).
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize(
    "basis",
    [KroneckerBasis(), KroneckerBasis(noise_filter=NoiseFilter())],
    ids=["kronecker", "noise-filter"],
)
def test_a_bfloat16_checkpoint_keeps_the_float32_state_and_resumes_bitwise(basis):
    """The float32 factors and moments, which torch's loader would round to bfloat16."""
    runs = []
    for _ in range(2):
        model, inputs, targets = _bfloat16_problem()
        model, loss_fn = extend(model), extend(nn.CrossEntropyLoss())
        runs.append((model, loss_fn, inputs, targets))
    (first, *rest), (second, *_) = runs

    def optimizer_of(model: nn.Module) -> DampedNewton:
        return DampedNewton(model.parameters(), basis=basis, seed=0)

    uninterrupted = optimizer_of(first)
    closure = make_closure(uninterrupted, first, *rest)
    saved = optimizer_of(second)
    for _ in range(5):
        uninterrupted.step(closure)
        saved.step(make_closure(saved, second, *rest))
    buffer = io.BytesIO()
    torch.save(saved.state_dict(), buffer)
    buffer.seek(0)
    resumed = optimizer_of(second)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    expected = {
        name: value.dtype
        for name, value in saved.state[second[0].weight].items()
        if isinstance(value, torch.Tensor)
    }
    assert set(expected.values()) == {torch.float32}
    actual = resumed.state[second[0].weight]
    assert {name: actual[name].dtype for name in expected} == expected
    other = make_closure(resumed, second, *rest)
    for _ in range(6):  # across the refresh at step 7
        uninterrupted.step(closure)
        resumed.step(other)
    for mine, theirs in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("basis", ["kronecker", "gram"])
@pytest.mark.parametrize("steps_before", [0, 2], ids=["refresh", "between"])
def test_autocast_is_refused_with_the_half_precision_model_instead(steps_before, basis):
    """On every step: at a refresh, and switched on between refreshes."""
    generator = torch.Generator().manual_seed(0)
    model = extend(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)))
    loss_fn = extend(nn.CrossEntropyLoss())
    inputs = torch.randn(8, 6, generator=generator)
    targets = torch.randint(0, 3, (8,), generator=generator)
    options = {"basis": GramBasis()} if basis == "gram" else {}
    optimizer = DampedNewton(model.parameters(), seed=0, **options)

    def closure(autocast: bool):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss

    for _ in range(steps_before):
        optimizer.step(lambda: closure(False))
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(
        RuntimeError, match=r"(?s)autocast.*model\.to\(torch\.bfloat16\)"
    ):
        optimizer.step(lambda: closure(True))
    assert all(
        torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True)
    )
    assert optimizer.records["global"]["step"] == steps_before


@pytest.mark.parametrize("basis", ["kronecker", "gram"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_a_half_model_with_binary_cross_entropy_samples_its_curvature(dtype, basis):
    """BackPACK's own draws need ``torch.binomial``, which has no half CPU kernel."""
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).to(dtype)
    inputs = torch.randn(32, 6, generator=generator)
    targets = (inputs[:, :1] > 0).to(dtype)
    model, loss_fn = extend(model), extend(nn.BCEWithLogitsLoss())
    options = {"basis": GramBasis()} if basis == "gram" else {}
    optimizer = DampedNewton(model.parameters(), seed=0, **options)
    closure = make_closure(optimizer, model, loss_fn, inputs.to(dtype), targets)
    first = optimizer.step(closure)
    for _ in range(10):
        last = optimizer.step(closure)
    assert all(p.dtype == dtype for p in model.parameters())
    assert last < first


@pytest.mark.parametrize(
    "basis",
    [KroneckerBasis(), KroneckerBasis(noise_filter=NoiseFilter()), GramBasis()],
    ids=["kronecker", "noise-filter", "gram"],
)
@pytest.mark.parametrize(
    ("before", "after"),
    [(torch.float32, torch.float64), (torch.float64, torch.float32)],
    ids=["to-float64", "to-float32"],
)
def test_a_model_converted_mid_run_steps_as_if_resumed_in_its_new_dtype(
    basis, before, after
):
    """``model.to(dtype)`` between steps: the state follows the parameters.

    Reference: the same run saved before the conversion and resumed by a new
    optimizer of the converted model (``load_state_dict`` converts the state). Both
    go on across the next refreshes (Kronecker: 7; Gram: 7 and its interval's).
    """
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(16, 6, generator=generator, dtype=before)
    targets = torch.randint(0, 3, (16,), generator=generator)
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).to(before)
        models.append(extend(net))
    loss_fn = extend(nn.CrossEntropyLoss())
    converted, resumed_model = models
    optimizers = [
        DampedNewton(model.parameters(), basis=basis, seed=0, momentum=0.5)
        for model in models
    ]
    for optimizer, model in zip(optimizers, models, strict=True):
        closure = make_closure(optimizer, model, loss_fn, inputs, targets)
        for _ in range(5):  # past the refreshes at 0, 1, 3
            optimizer.step(closure)
    buffer = io.BytesIO()
    torch.save(optimizers[1].state_dict(), buffer)
    buffer.seek(0)
    for model in models:
        model.to(after)
    resumed = DampedNewton(
        resumed_model.parameters(), basis=basis, seed=0, momentum=0.5
    )
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    inputs = inputs.to(after)
    runs = [(optimizers[0], converted), (resumed, resumed_model)]
    for optimizer, model in runs:
        closure = make_closure(optimizer, model, loss_fn, inputs, targets)
        for _ in range(20):
            optimizer.step(closure)
    for mine, theirs in zip(
        converted.parameters(), resumed_model.parameters(), strict=True
    ):
        assert mine.dtype == after
        assert torch.equal(mine, theirs)
    for param in converted.parameters():
        for name, value in optimizers[0].state[param].items():
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                assert value.dtype == after, name


@pytest.mark.parametrize(
    "basis", [KroneckerBasis(), GramBasis()], ids=["kronecker", "gram"]
)
@pytest.mark.parametrize("how", ["loaded", "copied"])
def test_a_model_converted_after_its_optimizer_was_loaded_or_copied(basis, how):
    """The first step after a load or a copy compares the state with the parameters.

    Reference: the checkpoint loaded into the converted model.
    """
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(16, 6, generator=generator)
    targets = torch.randint(0, 3, (16,), generator=generator)
    loss_fn = extend(nn.CrossEntropyLoss())

    def model_and_optimizer():
        torch.manual_seed(0)
        model = extend(nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)))
        return model, DampedNewton(model.parameters(), basis=basis, seed=0)

    model, optimizer = model_and_optimizer()
    closure = make_closure(optimizer, model, loss_fn, inputs, targets)
    for _ in range(5):
        optimizer.step(closure)
    saved = copy.deepcopy((model.state_dict(), optimizer.state_dict()))
    if how == "copied":
        model, optimizer = copy.deepcopy((model, optimizer))
    else:
        model, optimizer = model_and_optimizer()
        model.load_state_dict(saved[0])
        optimizer.load_state_dict(saved[1])
    model.double()
    reference, reference_optimizer = model_and_optimizer()
    reference.load_state_dict(saved[0])
    reference.double()
    reference_optimizer.load_state_dict(saved[1])
    for run, run_optimizer in ((model, optimizer), (reference, reference_optimizer)):
        closure = make_closure(run_optimizer, run, loss_fn, inputs.double(), targets)
        for _ in range(6):  # across the refresh at step 7
            run_optimizer.step(closure)
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        assert mine.dtype == torch.float64
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("criterion", [EigenvalueThreshold(0.0), TopK(24)], ids=repr)
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_precision_round_off_is_no_curvature_direction(dtype, criterion):
    """The cross-entropy GGN of N=8 samples and C=3 classes has rank N·(C−1) = 16.

    Its Gram matrix has 24 rows: 8 null directions, which the half-precision
    square root lifts to about ``ε²·λ_max`` (above float32's ``n·ε·λ_max``). They
    are round-off: the step keeps the float64 reference's 16 directions.
    """
    model, inputs, targets = _bfloat16_problem(dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(0.5)
    reference_model = copy.deepcopy(model).to(torch.float64)
    counts = []
    for stepped, X in ((model, inputs), (reference_model, inputs.double())):
        stepped, loss_fn = extend(stepped), extend(nn.CrossEntropyLoss())
        options = {**EXACT_VIVIT_STEP, "criterion": criterion, "damping": 1e-3}
        optimizer = DampedNewton(stepped.parameters(), **options)
        optimizer.step(make_closure(optimizer, stepped, loss_fn, X, targets))
        stats = optimizer.records["groups"][0]
        counts.append(int((stats["coefficients"] != 0).sum()))
    assert counts == [16, 16]
