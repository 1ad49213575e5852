"""A step with constant damping reads the device once, on either basis.

On a GPU every host read of a device value is a synchronization that stalls the
launch queue. The step's checks and counts, BackPACK's check that the loss was not
scaled included, are read together (``dampednewton._step.step_status``). Counted on the
CPU with :class:`~benchmarks.micro.host_reads.HostReads`, and on CUDA with torch's sync
debug mode.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from backpack import extend
from torch import nn

from benchmarks.micro.host_reads import HostReads
from benchmarks.micro.step_profile import EigensolverCalls
from dampednewton import (
    CurvatureAveraging,
    DampedNewton,
    GramBasis,
    KroneckerBasis,
    LevenbergMarquardt,
    NoiseFilter,
)
from dampednewton._step.kronecker_checks import read_checks
from dampednewton.backpack.loss_checks import DeferredChecks
from dampednewton.math.cost import prefers_partial_eigensolver
from dampednewton.math.linalg import top_eigh
from tests.assertions import assert_close, assert_close_up_to_sign

GRAM = GramBasis()
CONFIGURATIONS = {
    "vivit-mc1": {
        "basis": GRAM,
        "mc_samples": 1,
        "complement": None,
        "averaging": None,
    },
    "vivit-exact": {
        "basis": GRAM,
        "mc_samples": 0,
        "complement": None,
        "averaging": None,
    },
    "complement-exact": {"basis": GRAM, "mc_samples": 0, "averaging": None},
    "gram-defaults-mc1": {"basis": GRAM, "mc_samples": 1},
    "frozen-steps-mc1": {
        "basis": GRAM,
        "mc_samples": 1,
        "averaging": CurvatureAveraging(interval=20, ramp=False),
    },
    "averaging-every-step-exact": {
        "basis": GRAM,
        "mc_samples": 0,
        "averaging": CurvatureAveraging(interval=1),
    },
    "kronecker-defaults-mc1": {},
    "kronecker-every-step-exact": {"mc_samples": 0, "averaging": None},
    "kronecker-truncated-mc1": {
        "basis": KroneckerBasis(rank=4, exact_size=0),
        "averaging": None,
    },
    "kronecker-noise-filter-mc1": {
        "basis": KroneckerBasis(rank=4, exact_size=0, noise_filter=NoiseFilter()),
    },
}


def _training(device: str, options: dict):
    generator = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 10))
    model = extend(model.to(device=device, dtype=torch.float64))
    loss_fn = extend(nn.CrossEntropyLoss())
    inputs = torch.randn(32, 8, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 10, (32,), generator=generator)
    inputs, targets = inputs.to(device), targets.to(device)
    optimizer = DampedNewton(
        model.parameters(), criterion=5, damping=0.1, seed=0, **options
    )

    def closure():
        optimizer.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        return loss

    return optimizer, closure


def _quiet_steps(optimizer, closure, steps: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            optimizer.step(closure)


@pytest.mark.parametrize("options", CONFIGURATIONS.values(), ids=CONFIGURATIONS)
def test_a_step_reads_the_device_once(options):
    optimizer, closure = _training("cpu", options)
    # Past the first steps: warnings given, averaged factors of full rank.
    _quiet_steps(optimizer, closure, 6)
    for _ in range(3):
        with HostReads() as reads:
            optimizer.step(closure)
        assert reads.of("dampednewton/") == 1, dict(reads.counts)
        assert sum(reads.counts.values()) == 1, dict(reads.counts)


def test_the_partial_eigensolver_checks_once_unless_it_stops_early():
    # A 640-row Gram matrix of the exact GGN of 64 samples: its top 5 eigenpairs
    # come from block Krylov (math.cost.prefers_partial_eigensolver).
    assert prefers_partial_eigensolver(640, 5)
    generator = torch.Generator().manual_seed(0)
    factor = torch.randn(640, 64, generator=generator, dtype=torch.float64)
    factor = factor * 0.8 ** torch.arange(64)  # a decaying spectrum, as GGNs have
    gram = factor @ factor.T
    results, checks = {}, {}
    for stop_early in (True, False):  # the CPU's default, and the GPU's
        with HostReads() as reads:
            results[stop_early] = top_eigh(
                gram, 5, generator=torch.Generator(), stop_early=stop_early
            )
        checks[stop_early] = reads.of("dampednewton/math/linalg.py")
    # Stopping early, it checked after each of the blocks it built (here several).
    assert checks == {True: checks[True], False: 1} and checks[True] > 1, checks
    (early_values, early_vectors), (late_values, late_vectors) = results.values()
    assert_close(late_values, early_values, rtol=1e-9, atol=0, name="eigenvalues")
    assert_close_up_to_sign(late_vectors, early_vectors, dim=-1, rtol=1e-6, atol=1e-8)


def test_levenberg_marquardt_adds_one_read_on_its_adaptation_steps():
    # Levenberg-Marquardt adapts on refreshes: refresh every step here.
    every_step = CurvatureAveraging(interval=1)
    optimizer, closure = _training(
        "cpu", {"basis": GRAM, "mc_samples": 1, "averaging": every_step}
    )
    optimizer.param_groups[0]["damping"] = LevenbergMarquardt(value=0.1, interval=5)
    _quiet_steps(optimizer, closure, 6)
    reads_per_step = []
    for _ in range(5):
        with HostReads() as reads:
            optimizer.step(closure)
        reads_per_step.append(sum(reads.counts.values()))
    # The loss after the step, the loss before and the predicted change, together.
    assert sorted(reads_per_step) == [1, 1, 1, 1, 2], reads_per_step


def test_the_counter_sees_the_reads_it_should():
    values = torch.tensor([0.0, 1.0, 2.0])
    with HostReads() as reads:
        values.tolist()
        bool(values.sum() > 0)
        values[values > 0]
    # Origin "elsewhere": these reads are the test's own.
    assert reads.counts["elsewhere"] == 3


def test_the_eigensolver_counter_sees_each_call():
    matrix = torch.eye(3, dtype=torch.float64)
    with EigensolverCalls() as calls:
        torch.linalg.eigh(matrix)
        torch.linalg.eigvalsh(torch.stack([matrix, matrix]))
        torch.linalg.qr(matrix)
    assert calls.count == 2


@pytest.mark.cuda
@pytest.mark.parametrize("steps_before", [6, 7], ids=["between-refreshes", "refresh"])
@pytest.mark.parametrize("options", CONFIGURATIONS.values(), ids=CONFIGURATIONS)
def test_a_cuda_step_synchronizes_as_counted(options, steps_before):
    optimizer, closure = _training("cuda", options)
    _quiet_steps(optimizer, closure, steps_before)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught, EigensolverCalls() as solves:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            optimizer.step(closure)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Not the notice that the debug mode is a prototype (a process's first warning).
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    # The step's one read, and cuSOLVER's check of each eigendecomposition's result
    # (its info: one per call, a call per Gram matrix or per shape of Kronecker
    # factor on the refreshes that rotate the eigenbases; none between refreshes).
    assert len(syncs) <= 1 + solves.count, (len(syncs), solves.count)


def test_the_kronecker_checks_read_mixed_dtypes_in_one_stack():
    class Sloped:
        def __init__(self, slope: torch.Tensor):
            self.slope = slope

    deferred = DeferredChecks()
    deferred.ignored_targets = torch.tensor(3)
    deferred.model_output_finite = torch.tensor(False)
    deferred.loss_unscaled = torch.tensor(True)
    slope64 = torch.tensor(-0.1, dtype=torch.float64)
    loss = torch.tensor([0.25], requires_grad=True)  # a [1]-shaped loss
    with HostReads() as reads:
        values = read_checks(
            loss, [Sloped(slope64), None], deferred, torch.tensor(True)
        )
    assert sum(reads.counts.values()) == 1
    assert values == {
        "loss": 0.25,
        "slopes": [-0.1, 0.0],
        "ignored": 3,
        "output_finite": False,
        "loss_unscaled": True,
        "factors_finite": True,
    }
