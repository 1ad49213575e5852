"""The graph-memory script: refuses a machine without CUDA, reads the allocator."""

from __future__ import annotations

import pytest
import torch

from benchmarks.micro.graph_memory import EARLY_STEP, allocated_mib, main


def test_graph_memory_needs_cuda_and_enough_steps():
    if torch.cuda.is_available():
        with pytest.raises(SystemExit, match=f"--steps above {EARLY_STEP}"):
            main(["--steps", str(EARLY_STEP)])
    else:
        with pytest.raises(SystemExit, match="needs CUDA"):
            main([])


@pytest.mark.cuda
def test_the_defaults_graphs_do_not_pile_up_across_refreshes():
    """Between step 40 and step 130 six refreshes each record a new graph."""
    early, late, peak = allocated_mib("default", "mlp", 64, 130)
    assert 0 < early <= peak
    # The replaced packs' graphs are freed: what stays allocated does not grow with
    # the recordings (a graph's outputs on this MLP are about 0.5 MiB).
    assert late <= early + 0.5, (early, late)
