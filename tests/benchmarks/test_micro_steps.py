"""The micro-benchmarks build the steps they name, for every model they offer."""

from __future__ import annotations

import pytest
import torch

from benchmarks.micro import compile_cost, cpu_threads
from benchmarks.micro.harness import MODELS, make_step

CPU = torch.device("cpu")


@pytest.mark.parametrize("variant", ["fast:MC1", "defaults", "default:mc2", "Adam"])
def test_a_mistyped_variant_is_refused_with_the_variants(variant):
    """A typo would have run another step (the exact GGN, the dense path)."""
    with pytest.raises(ValueError, match=r"Unknown step variant.*fast:mc1"):
        make_step(variant, "mlp", 4, CPU)


@pytest.mark.parametrize("model", list(MODELS))
def test_the_compile_and_thread_scripts_take_every_model(model):
    """Each builds its inputs in the model's shape (3c3d's are 3×32×32)."""
    step, _ = compile_cost.make_step("dampednewton", False, 4, model)
    step()
    cpu_threads.make_step(model, "defaults", 4)()


@pytest.mark.parametrize(
    "variant", ["default:per_layer", "default:packed", "default:graphed"]
)
def test_the_layout_variants_take_steps(variant):
    """``default:graphed`` is the packed step on the CPU (a CUDA graph on a GPU)."""
    step = make_step(variant, "mlp-tiny", 8, CPU)
    for _ in range(3):  # a refresh, then steps between (the graph's second step)
        step()
