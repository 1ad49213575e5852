"""The in-between step's math under ``torch.compile`` gives the eager directions."""

from __future__ import annotations

import pytest
import torch

from benchmarks.micro.between_compile import (
    largest_relative_difference,
    math_arguments,
    trained,
)
from dampednewton._step.kronecker_group import group_step


@pytest.mark.slow
def test_compiled_math_between_refreshes_matches_eager():
    optimizer, _, _ = trained("mlp", 16, torch.device("cpu"))
    arguments = math_arguments(optimizer)
    eager = group_step(*arguments)
    compiled = torch.compile(group_step)(*arguments)
    # Float32 directions; Inductor may fuse and reorder the sums.
    assert largest_relative_difference(compiled, eager) < 1e-5
    assert compiled.slope.item() == pytest.approx(eager.slope.item(), rel=1e-5)
    assert eager.slope.item() < 0  # a descent direction
