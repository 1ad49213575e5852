"""The defaults' refreshes through ``torch.autograd.grad`` against BackPACK's pass.

From the second refresh on, the default optimizer back-propagates the sampled
curvature with one ``torch.autograd.grad`` instead of BackPACK's module-by-module pass
(``dampednewton/backpack/autograd_factors.py``); ``default:backpack`` keeps BackPACK's
pass for every refresh (the optimizer's private switch). The two optimizers start from
the same model and take the same batch in turns, alternating which goes first, each
step timed alone; the table gives per phase
(:func:`~benchmarks.micro.step_phases.step_kinds`) the median times and their ratio,
and the sum over all steps but the first (BackPACK's pass in both).

Not a test: run it where the numbers are wanted::

    python -m benchmarks.micro.refresh_pass --models mlp-tiny mlp cnn --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from benchmarks.measure import synchronize
from benchmarks.micro.harness import MODELS, make_step, script_device
from benchmarks.micro.step_phases import PHASES, step_kinds

VARIANTS = ("default", "default:backpack")
"""The autograd refreshes (the defaults) and BackPACK's, in the table's order."""


def compare(model: str, batch_size: int, device: torch.device, steps: int) -> list[str]:
    """The table's rows of one model: each phase's medians, then all steps' sums."""
    run = {
        variant: make_step(variant, model, batch_size, device) for variant in VARIANTS
    }
    times: dict[tuple[str, str], list[float]] = {
        (variant, phase): [] for variant in VARIANTS for phase in PHASES
    }
    for index, phase in enumerate(step_kinds(steps)):
        for variant in VARIANTS if index % 2 else VARIANTS[::-1]:
            synchronize(device)
            start = time.perf_counter()
            run[variant]()
            synchronize(device)
            if index > 0:  # the first refresh is BackPACK's in both
                times[(variant, phase)].append((time.perf_counter() - start) * 1e3)
    rows = []
    for phase in PHASES:
        if not times[(VARIANTS[0], phase)]:
            continue  # too few steps for the phase
        autograd, backpack = (statistics.median(times[(v, phase)]) for v in VARIANTS)
        rows.append(
            f"| {model} | {phase} | {len(times[(VARIANTS[0], phase)])} | "
            f"{autograd:.2f} | {backpack:.2f} | {autograd / backpack:.2f} |"
        )
    autograd, backpack = (
        sum(sum(times[(v, phase)]) for phase in PHASES) for v in VARIANTS
    )
    rows.append(
        f"| {model} | all | {steps - 1} | {autograd:.1f} | {backpack:.1f} | "
        f"{autograd / backpack:.3f} |"
    )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp-tiny"], choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    device, name = script_device(args.threads)
    print(f"device {name}, N={args.batch_size}, {torch.get_num_threads()} threads")
    print("| model | phase | steps | autograd ms | BackPACK ms | ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for model in args.models:
        for row in compare(model, args.batch_size, device, args.steps):
            print(row, flush=True)


if __name__ == "__main__":
    main()
