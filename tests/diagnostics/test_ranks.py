"""What reducers exchange under data parallelism, against one process (no spawning).

The spawned gloo tests are in ``tests/distributed/test_monitor.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dampednewton.diagnostics import (
    DiagnosticsMonitor,
    FixedRange,
    GradientHistogram,
    MaxAbsRange,
    PercentileRange,
)
from dampednewton.diagnostics.bin_adaptation import range_of_largest_magnitude
from dampednewton.diagnostics.ranks import (
    SINGLE_PROCESS,
    agreed_ranges,
    check_agreeable,
    global_batch,
    summed_over_ranks,
)


class OtherRank:
    """Two ranks: this one and another that holds ``other`` (a function of ours)."""

    world_size = 2

    def __init__(self, other) -> None:
        self.other = other

    def sum_over_ranks(self, tensor: Tensor) -> Tensor:
        return tensor + self.other(tensor)

    def max_over_ranks(self, tensor: Tensor) -> Tensor:
        return torch.maximum(tensor, self.other(tensor))

    def stack_over_ranks(self, tensor: Tensor) -> Tensor:
        return torch.stack([tensor, self.other(tensor)])


@pytest.mark.parametrize("policy", [MaxAbsRange(0.1), FixedRange(-2.0, 3.0)])
def test_range_of_largest_magnitude_is_the_policys_range(policy):
    values = torch.randn(
        50, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    values[3] = torch.inf
    largest = values[values.isfinite()].abs().max().item()
    assert range_of_largest_magnitude(policy, largest) == policy.compute(values)


def test_percentile_ranges_cannot_be_agreed_on():
    with pytest.raises(ValueError, match="MaxAbsRange or FixedRange"):
        check_agreeable([MaxAbsRange(), PercentileRange()])
    reducer = GradientHistogram(range_policy=PercentileRange()).make_reducer()
    reducer.begin(SINGLE_PROCESS)
    with pytest.raises(ValueError, match="MaxAbsRange or FixedRange"):
        reducer.begin(OtherRank(lambda tensor: tensor))


def test_agreed_ranges_are_those_of_the_concatenated_values():
    generator = torch.Generator().manual_seed(1)
    mine = [
        torch.randn(4, 3, dtype=torch.float64, generator=generator) for _ in range(2)
    ]
    theirs = [
        3 * torch.randn(4, 3, dtype=torch.float64, generator=generator)
        for _ in range(2)
    ]
    magnitudes = torch.tensor(
        [[t.abs().max().item()] for t in theirs], dtype=torch.float64
    )
    ranks = OtherRank(lambda tensor: magnitudes)
    policy = MaxAbsRange(0.05)
    ranges = agreed_ranges([policy], [(values,) for values in mine], ranks)
    assert ranges == [
        (policy.compute(torch.cat([m, t])),) for m, t in zip(mine, theirs, strict=True)
    ]


def test_summed_over_ranks_keeps_shapes_in_one_collective():
    calls = []

    def other(tensor: Tensor) -> Tensor:
        calls.append(tensor.shape)
        return torch.arange(tensor.numel(), dtype=tensor.dtype)

    tensors = [torch.ones(2, 3, dtype=torch.int64), torch.tensor(5, dtype=torch.int64)]
    summed = summed_over_ranks(tensors, OtherRank(other))
    assert calls == [torch.Size([7])]
    assert torch.equal(summed[0], torch.tensor([[1, 2, 3], [4, 5, 6]]))
    assert torch.equal(summed[1], torch.tensor(11))
    assert summed_over_ranks(tensors, SINGLE_PROCESS)[0] is tensors[0]


def test_global_batch_sums_sizes_and_averages_losses():
    assert global_batch(SINGLE_PROCESS, 4, torch.tensor(0.5)) == (4, 0.5)
    assert global_batch(SINGLE_PROCESS, 4, None) == (4, None)
    other = OtherRank(lambda row: torch.tensor([4.0, 1.5], dtype=torch.float64))
    assert global_batch(other, 4, 0.5) == (8, 1.0)
    assert global_batch(other, 4, None) == (8, None)
    unequal = OtherRank(lambda row: torch.tensor([5.0, 1.5], dtype=torch.float64))
    with pytest.raises(RuntimeError, match=r"equal local batch sizes, got \[4, 5\]"):
        global_batch(unequal, 4, 0.5)


def test_a_monitor_outside_torch_distributed_communicates_nothing():
    monitor = DiagnosticsMonitor([GradientHistogram()])
    assert monitor.communicator is None
    assert monitor.communication_bytes == 0.0
    with pytest.raises(TypeError, match="process_group must be None"):
        DiagnosticsMonitor([GradientHistogram()], process_group="world")
