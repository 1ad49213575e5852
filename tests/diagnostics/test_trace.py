"""Curvature names, extensions and trace sums."""

from __future__ import annotations

import pytest
import torch
from backpack.extensions import DiagGGNExact, DiagGGNMC, DiagHessian

from dampednewton.diagnostics.trace import (
    CURVATURES,
    curvature_extension,
    diagonal_trace,
    total_trace,
)


@pytest.mark.parametrize(
    ("curvature", "extension_type"),
    [
        ("diag_h", DiagHessian),
        ("diag_ggn_exact", DiagGGNExact),
        ("diag_ggn_mc", DiagGGNMC),
    ],
)
def test_extension_writes_the_named_attribute(curvature, extension_type):
    extension = curvature_extension(curvature, mc_samples=2)
    assert isinstance(extension, extension_type)
    assert extension.savefield == curvature
    assert curvature in CURVATURES


def test_traces_are_sums():
    diagonals = [torch.arange(6.0).reshape(2, 3), torch.tensor([0.5, -1.0])]
    traces = [diagonal_trace(d) for d in diagonals]
    assert [t.item() for t in traces] == [15.0, -0.5]
    assert total_trace(traces).item() == 14.5


def test_bad_input_raises():
    with pytest.raises(ValueError, match="Unknown curvature"):
        curvature_extension("diag_kfac")
    with pytest.raises(ValueError, match="at least one"):
        total_trace([])
