"""The default step by phase: between refreshes, a refresh, a refresh that rotates.

The defaults refresh the averaged Kronecker factors on their
:class:`~dampednewton.CurvatureAveraging`'s schedule (steps 0, 1, 3, 7, 15, then every
15) and recompute the eigenvectors on the refreshes that
:meth:`~dampednewton.KroneckerBasis.rotates` names (every refresh by default; past the
first five by one QR each, without an eigensolver): past the ramp a period of 45 steps
holds 42 steps between refreshes and three rotating refreshes (with
``KroneckerBasis(rotation_interval=3)``: two refreshes of the eigenvalues along the
kept eigenvectors and one rotating). :func:`step_kinds` names each step's phase from
those policies; a phase the period does not hold gets no row. Each step of
``--periods`` periods is timed alone (the device synchronized before and after it),
and each step of the next two periods counted alone: reads and synchronizations in
the first (no profiler and no synchronization of the script's own inside the counted
window), kernels and busy time in the second. Per phase the table gives the median
time and the median counts of its steps:

* ``kernels``: CUDA kernels launched (``torch.profiler``); on the CPU, ATen operators
  that compute (views excluded), the proxy of launches;
* ``reads``: host reads of device values
  (:class:`~benchmarks.micro.host_reads.HostReads`);
* ``syncs``: CUDA synchronizations that torch reports, cuSOLVER's checks included;
* ``busy``: the kernels' summed time on the GPU.

The amortized row is the mean of all timed steps of the periods.

Not a test: run it where the numbers are wanted::

    python -m benchmarks.micro.step_phases --models mlp 3c3d
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable, Sequence

import torch

from benchmarks.measure import synchronize
from benchmarks.micro.harness import MODELS, make_step, script_device
from benchmarks.micro.host_reads import HostReads
from benchmarks.micro.step_profile import (
    SYNCHRONIZING,
    ComputingOperators,
    cuda_kernels,
)
from dampednewton import DampedNewton

PHASES = ("between", "refresh", "rotating")
"""A default step's phases, in the order of the table."""

PERIOD = 45
"""Steps after which the defaults' pattern of refreshes repeats past the ramp."""


def step_kinds(count: int) -> list[str]:
    """The phase of each of the defaults' first ``count`` steps (:data:`PHASES`).

    Args:
        count: Steps from the first.

    Returns:
        ``between``, ``refresh`` (eigenvalues along the kept eigenvectors) or
        ``rotating`` (the eigenvectors recomputed), step by step.
    """
    # The defaults as the optimizer fills them in (its param group's policies).
    group = DampedNewton([torch.zeros(1, requires_grad=True)]).param_groups[0]
    averaging, basis = group["averaging"], group["basis"]
    kinds, refreshes = [], 0
    for step in range(count):
        if averaging.refreshes(step, refreshes):
            kinds.append("rotating" if basis.rotates(refreshes) else "refresh")
            refreshes += 1
        else:
            kinds.append("between")
    return kinds


def reads_and_syncs(step: Callable[[], object], device: torch.device) -> dict[str, int]:
    """One step's host reads and the CUDA synchronizations torch reports in it.

    The device is synchronized before and after, outside the counted window (a
    synchronization there would count too).
    """
    synchronize(device)
    with warnings.catch_warnings(record=True) as caught, HostReads() as reads:
        warnings.simplefilter("always")
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    synchronize(device)
    syncs = sum(SYNCHRONIZING in str(w.message) for w in caught)
    return {"reads": sum(reads.counts.values()), "syncs": syncs}


def kernels_and_busy(
    step: Callable[[], object], device: torch.device
) -> dict[str, float]:
    """One step's CUDA kernels and their summed GPU time (on the CPU: operators)."""
    synchronize(device)
    if device.type != "cuda":
        with ComputingOperators() as operators:
            step()
        return {"kernels": operators.count, "busy": 0.0}
    launched, busy = cuda_kernels(step, device)
    return {"kernels": launched, "busy": busy}


def timed_step(step: Callable[[], object], device: torch.device) -> float:
    """One step's milliseconds, alone, without counting (no counters' overhead)."""
    synchronize(device)
    start = time.perf_counter()
    step()
    synchronize(device)
    return 1e3 * (time.perf_counter() - start)


def phase_rows(
    model: str, variant: str, batch_size: int, device: torch.device, periods: int
) -> list[str]:
    """Table rows of one default variant: per phase, its median step and counts.

    The first ``periods`` periods past the ramp's end (step 90) are timed; in the
    next period each step's reads and synchronizations are counted, in the one after
    it its kernels (operators) and busy time.
    """
    step = make_step(variant, model, batch_size, device)
    start = 2 * PERIOD  # past the ramp: the pattern of every later period
    counted = start + periods * PERIOD
    kinds = step_kinds(counted + 2 * PERIOD)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(start):
            step()
        times: dict[str, list[float]] = {phase: [] for phase in PHASES}
        for kind in kinds[start:counted]:
            times[kind].append(timed_step(step, device))
        counts: dict[str, list[dict[str, int]]] = {phase: [] for phase in PHASES}
        for kind in kinds[counted : counted + PERIOD]:
            counts[kind].append(reads_and_syncs(step, device))
        launches: dict[str, list[dict[str, float]]] = {phase: [] for phase in PHASES}
        for kind in kinds[counted + PERIOD :]:
            launches[kind].append(kernels_and_busy(step, device))
    rows = []
    for phase in (phase for phase in PHASES if times[phase]):
        medians = {
            key: statistics.median(count[key] for count in counts[phase])
            for key in ("reads", "syncs")
        } | {
            key: statistics.median(count[key] for count in launches[phase])
            for key in ("kernels", "busy")
        }
        busy = f"{medians['busy']:.2f}" if device.type == "cuda" else "—"
        rows.append(
            f"| {model} | {variant} | {phase} | {len(times[phase])} "
            f"| {statistics.median(times[phase]):.2f} | {medians['kernels']:.0f} "
            f"| {medians['reads']:.0f} | {medians['syncs']:.0f} | {busy} |"
        )
    amortized = sum(sum(times[phase]) for phase in PHASES)
    rows.append(
        f"| {model} | {variant} | amortized | {periods * PERIOD} "
        f"| {amortized / (periods * PERIOD):.2f} | | | | |"
    )
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """Print the phase table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=MODELS)
    parser.add_argument(
        "--variants",
        nargs="+",
        default=["default", "default:packed"],
        choices=[
            "default",
            "default:exact",
            "default:per_layer",
            "default:packed",
            "default:graphed",
            "default:backpack",
        ],
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--periods", type=int, default=2, help="timed periods")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    device, name = script_device(args.threads)
    print(f"device {name}, N={args.batch_size}, {torch.get_num_threads()} threads")
    kernels = "kernels" if device.type == "cuda" else "ATen ops"
    print(
        f"| model | variant | phase | steps timed | median ms | {kernels} | host reads "
        "| syncs | busy ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for model in args.models:
        for variant in args.variants:
            for row in phase_rows(
                model, variant, args.batch_size, device, args.periods
            ):
                print(row)


if __name__ == "__main__":
    main()
