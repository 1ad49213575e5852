"""Memory of the CUDA default's graphs: allocated after early and late refreshes, peak.

On a CUDA device the default packs a group's layers and replays their math as a CUDA
graph, recorded once per run (:mod:`dampednewton._step.cuda_graphs`). For
each model and variant (``default``: packed and graphed; ``default:packed``: packed,
eager; ``default:per_layer``: by shape), this trains ``--steps`` steps of the default
schedule (refreshes at 0, 1, 3, 7, 15, then every 15) on random data and prints, in
MiB above what was allocated before the variant was built, the memory allocated after
step 40 (past the ramp's last refresh and its recording) and after the last step, and
the peak. Memory that grows from the first to the second would be graphs kept past
their packs; the peak is what the variant costs.

    python -m benchmarks.micro.graph_memory --models mlp 3c3d --steps 300
"""

from __future__ import annotations

import argparse
import gc
import sys
import warnings
from collections.abc import Sequence

import torch

from benchmarks.micro.harness import MODELS, make_step

VARIANTS = ("default", "default:packed", "default:per_layer")
EARLY_STEP = 40
"""Past the ramp's refresh at step 30 and its recording at step 32."""
MIB = 2**20


def allocated_mib(
    variant: str, model_name: str, batch_size: int, steps: int
) -> tuple[float, float, float]:
    """Allocated after step :data:`EARLY_STEP` and after the last, and the peak (MiB).

    Each above what was allocated before the variant's model and optimizer were built.
    """
    device = torch.device("cuda")
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step = make_step(variant, model_name, batch_size, device)
    early = 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for index in range(1, steps + 1):
            step()
            if index == EARLY_STEP:
                torch.cuda.synchronize()
                early = (torch.cuda.memory_allocated() - before) / MIB
    torch.cuda.synchronize()
    late = (torch.cuda.memory_allocated() - before) / MIB
    peak = (torch.cuda.max_memory_allocated() - before) / MIB
    del step
    gc.collect()
    return early, late, peak


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "3c3d"], choices=MODELS)
    parser.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("graph_memory needs CUDA: it reads a CUDA device's allocator.")
    if args.steps <= EARLY_STEP:
        sys.exit(f"graph_memory needs --steps above {EARLY_STEP}, got {args.steps}.")
    print(f"device {torch.cuda.get_device_name()}, N={args.batch_size}, MiB")
    print(
        f"| model | variant | after step {EARLY_STEP} | after step {args.steps} "
        "| peak |\n| --- | --- | --- | --- | --- |"
    )
    for model_name in args.models:
        for variant in args.variants:
            early, late, peak = allocated_mib(
                variant, model_name, args.batch_size, args.steps
            )
            print(
                f"| {model_name} | {variant} | {early:.1f} | {late:.1f} | {peak:.1f} |"
            )


if __name__ == "__main__":
    main()
