"""Packed steps replayed as CUDA graphs (``KroneckerBasis(packed=True, graphed=True)``).

A graphed optimizer takes the packed optimizer's steps: on the CPU its math runs as
it is, on a CUDA device each pack records its math once, on its second step, and
replays it from then on: refreshes and damping changes copy their values into the
buffers the recording reads. The tests on a CUDA device (marked ``cuda``) compare the
replays with the packed steps through refreshes, a damping change, several packs and
a half-precision model, and the recorded function with the eager one on new inputs; a
recording that fails falls back to computing, with a warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from backpack import extend

from dampednewton import CurvatureAveraging, DampedNewton, KroneckerBasis
from dampednewton._step import cuda_graphs
from dampednewton._step.cuda_graphs import EAGER_CALLS, ReplayedMath
from dampednewton._step.kronecker_packed import PackedGroup
from tests.case_models import wide_then_narrow_mlp
from tests.cases import KRONECKER_PROBLEMS, case_by_id
from tests.utils import (
    assert_same_parameters,
    build_case,
    make_closure,
    run_steps,
)

BASIS = {"rank": 3, "exact_size": 4}
"""Factors of the test problems truncated (residual blocks) and exact."""


def twins(problem, device: str, dtype: torch.dtype = torch.float64):
    """The problem twice: packed, then packed and graphed (refreshes 0, 1, 3, 7)."""
    return trainings(
        problem,
        device,
        [
            KroneckerBasis(**BASIS, packed=True, graphed=False),
            KroneckerBasis(**BASIS, packed=True, graphed=True),
        ],
        dtype,
    )


def trainings(
    problem,
    device: str,
    bases: list[KroneckerBasis],
    dtype: torch.dtype = torch.float64,
):
    """The problem once per basis, each optimizer beside its case."""
    runs = []
    for basis in bases:
        case = build_case(problem, dtype, device)
        optimizer = DampedNewton(
            case.model.parameters(),
            basis=basis,
            averaging=CurvatureAveraging(interval=100),
            seed=0,
        )
        runs.append((optimizer, case))
    return runs


def packs(optimizer: DampedNewton) -> PackedGroup:
    """The packed layers of the optimizer's one group (the Kronecker step's cache)."""
    return optimizer._pipeline.kronecker._packs[0]


def replaying(optimizer: DampedNewton) -> bool:
    """Whether every pack of the group replays a recorded CUDA graph."""
    return all(pack.replaying for pack in packs(optimizer).packs)


def assert_same_steps(
    packed: torch.nn.Module, graphed: torch.nn.Module, device: str
) -> None:
    """The graphed run's parameters are the packed run's.

    On the CPU bit for bit (the same operators); on a CUDA device a replay runs
    the recorded kernels, whose library may choose other algorithms on the
    recording's stream: float64 round-off.
    """
    if device == "cpu":
        for actual, expected in zip(
            graphed.parameters(), packed.parameters(), strict=True
        ):
            assert torch.equal(actual, expected)
        return
    assert_same_parameters(graphed, packed, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("problem", KRONECKER_PROBLEMS, ids=lambda p: p.id)
def test_graphed_steps_are_the_packed_steps(problem, device):
    (packed, first), (graphed, second) = twins(problem, device)
    for steps in (8, 4):  # refreshes at 0, 1, 3, 7; then three steps between
        run_steps(packed, first, steps)
        run_steps(graphed, second, steps)
        assert_same_steps(first.model, second.model, device)
    assert graphed.records["groups"][0]["curvature_updates"] == 4
    # Eager at step 0, recorded at step 1, replayed since (refreshes included).
    assert replaying(graphed) == (device == "cuda")
    assert not replaying(packed)


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_the_default_layout_is_packed_and_graphed_on_cuda_devices_only(device_type):
    device, on_cuda = torch.device(device_type), device_type == "cuda"
    assert KroneckerBasis().packs(device) == KroneckerBasis().graphs(device) == on_cuda
    assert KroneckerBasis(packed=True).packs(device)
    assert KroneckerBasis(packed=True).graphs(device) == on_cuda
    assert not KroneckerBasis(packed=True, graphed=False).graphs(device)
    assert not KroneckerBasis(packed=False).packs(device)
    assert KroneckerBasis(graphed=True).packs(device) == on_cuda


def test_the_default_basis_steps_as_the_devices_layout(device):
    """By shape on the CPU; packed and replayed as CUDA graphs on a CUDA device."""
    on_cuda = device == "cuda"
    explicit = KroneckerBasis(**BASIS, packed=on_cuda, graphed=on_cuda)
    (default, first), (laid_out, second) = trainings(
        case_by_id("cnn-ce"), device, [KroneckerBasis(**BASIS), explicit]
    )
    run_steps(default, first, 10)
    run_steps(laid_out, second, 10)
    assert_same_steps(second.model, first.model, device)  # the same path
    kronecker = default._pipeline.kronecker
    assert bool(kronecker._packs) == on_cuda
    assert not on_cuda or replaying(default)


def test_a_new_damping_replays_the_recorded_graph(device):
    (packed, first), (graphed, second) = twins(case_by_id("cnn-ce"), device)
    for optimizer, case in ((packed, first), (graphed, second)):
        run_steps(optimizer, case, 10)
    assert replaying(graphed) == (device == "cuda")
    pack = packs(graphed)
    for optimizer in (packed, graphed):
        optimizer.param_groups[0]["damping"] = 1e-2
    for _ in range(3):
        run_steps(packed, first, 1)
        run_steps(graphed, second, 1)
        assert_same_steps(first.model, second.model, device)
        assert packs(graphed) is pack  # no refresh: the same packs
        assert replaying(graphed) == (device == "cuda")


def test_a_group_in_several_packs_replays_each(device):
    """A wide first layer and narrow ones: three packs, each with its own graph."""
    models = []
    for graphed in (False, True):
        model = wide_then_narrow_mlp(torch.Generator().manual_seed(0))
        model = extend(model.to(device))
        loss_fn = extend(torch.nn.CrossEntropyLoss())
        generator = torch.Generator().manual_seed(1)
        X = torch.randn(16, 6, generator=generator, dtype=torch.float64).to(device)
        y = torch.randint(0, 2, (16,), generator=generator).to(device)
        optimizer = DampedNewton(
            model.parameters(),
            basis=KroneckerBasis(rank=4, exact_size=4, packed=True, graphed=graphed),
            averaging=CurvatureAveraging(interval=100),
            seed=0,
        )
        closure = make_closure(optimizer, model, loss_fn, X, y)
        for _ in range(12):  # refreshes at 0, 1, 3, 7
            optimizer.step(closure)
        assert len(packs(optimizer).packs) == 3
        assert replaying(optimizer) == (graphed and device == "cuda")
        models.append(model)
    assert_same_steps(models[0], models[1], device)


@pytest.mark.cuda
def test_a_half_precision_model_steps_graphed_as_packed():
    """bfloat16 gradients copied into the float32 buffer before each replay."""
    (packed, first), (graphed, second) = twins(
        case_by_id("cnn-ce"), "cuda", torch.bfloat16
    )
    run_steps(packed, first, 12)
    run_steps(graphed, second, 12)
    assert replaying(graphed)
    for actual, expected in zip(
        second.model.parameters(), first.model.parameters(), strict=True
    ):
        assert actual.dtype == torch.bfloat16
        # The same float32 steps up to the library's round-off, then rounded to
        # bfloat16: neighbouring values at most (2⁻⁷ relative) after 12 steps.
        gap = (actual.float() - expected.float()).abs()
        bound = torch.finfo(torch.bfloat16).eps * expected.float().abs() + 1e-6
        assert bool((gap <= bound).all()), gap.max()


@pytest.mark.cuda
def test_refreshes_replay_the_one_recorded_graph():
    """Every third step a refresh: each copies into the buffers the graph reads."""
    case = build_case(case_by_id("cnn-ce"), torch.float64, "cuda")
    graphed = DampedNewton(
        case.model.parameters(),
        basis=KroneckerBasis(**BASIS),  # packed and graphed on a CUDA device
        averaging=CurvatureAveraging(interval=3, ramp=False),
        seed=0,
    )
    run_steps(graphed, case, 9)  # refreshes at 0, 3, 6; recorded at step 1
    recordings = [pack._replayed for pack in packs(graphed).packs]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    run_steps(graphed, case, 30)  # ten more refreshes
    torch.cuda.synchronize()
    assert replaying(graphed)
    assert [pack._replayed for pack in packs(graphed).packs] == recordings
    assert torch.cuda.memory_allocated() <= allocated


@pytest.mark.cuda
def test_recordings_share_one_capture_stream_per_device():
    """A stream per recording would each keep a cuBLAS workspace for the process."""
    stream = cuda_graphs.capture_stream(torch.device("cuda"))
    index = torch.cuda.current_device()
    assert cuda_graphs.capture_stream(torch.device("cuda", index)) is stream
    assert stream != torch.cuda.current_stream()


@pytest.mark.cuda
def test_replays_compute_the_function_of_the_buffers_current_values():
    generator = torch.Generator(device="cuda").manual_seed(0)
    buffer = torch.randn(16, 8, device="cuda", dtype=torch.float64, generator=generator)
    weights = torch.randn(8, 4, device="cuda", dtype=torch.float64, generator=generator)

    def math() -> tuple[torch.Tensor, torch.Tensor]:
        product = buffer @ weights
        return product, product.square().sum()

    replayed = ReplayedMath(math, buffer.device)
    outputs = []
    for call in range(EAGER_CALLS + 3):
        buffer.copy_(torch.randn(16, 8, device="cuda", generator=generator).double())
        product, total = replayed()
        expected_product, expected_total = math()
        torch.testing.assert_close(product, expected_product, rtol=1e-13, atol=0)
        torch.testing.assert_close(total, expected_total, rtol=1e-13, atol=0)
        assert replayed.replaying == (call >= EAGER_CALLS)
        outputs.append(product)
    # The replays write into the recorded outputs.
    assert outputs[-1] is outputs[-2]


def test_a_failed_recording_warns_and_computes(monkeypatch):
    """A CUDA error while recording: the math runs as it is, from then on."""
    buffer = torch.arange(6.0, dtype=torch.float64)

    def math() -> torch.Tensor:
        return buffer * 2

    def failing(math, device):
        raise RuntimeError(
            "CUDA error: operation not permitted when stream is capturing"
        )

    monkeypatch.setattr(cuda_graphs, "record_graph", failing)
    replayed = ReplayedMath(math, torch.device("cpu"))
    for _ in range(EAGER_CALLS):
        torch.testing.assert_close(replayed(), buffer * 2, rtol=0, atol=0)
    with pytest.warns(
        RuntimeWarning, match="could not record.*operation not permitted"
    ):
        torch.testing.assert_close(replayed(), buffer * 2, rtol=0, atol=0)
    buffer.add_(1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second attempt, no second warning
        torch.testing.assert_close(replayed(), buffer * 2, rtol=0, atol=0)
    assert not replayed.replaying
