"""Where a default step's kernels go: per part of the pipeline, between and rotating.

Each of :data:`PARTS`, a function or method of the package, runs inside a
``torch.profiler.record_function`` range named after it while
:func:`labelled_parts` is active (the package's own code is left as it was after).
One step between refreshes and one rotating refresh past the ramp (step 90 on, as
:mod:`~benchmarks.micro.step_phases` names them) are profiled; every ATen operator is
charged to its innermost part (``(other)``: outside all of them, such as the
closure's ``backward`` that autograd runs on its own thread), with:

* ``kernels``: the CUDA kernels it launched (0 on the CPU) and their ``busy`` time;
* ``operators``: top-level ATen operators (views included: on the CPU the proxy of
  the host's work);
* the part's launchers: the operators with the most kernels (on the CPU the most
  frequent operators).

A nested part's kernels are not in its parent's row. Not a test: run it where the
numbers are wanted::

    python -m benchmarks.micro.step_parts --models mlp 3c3d
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import importlib
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.measure import synchronize
from benchmarks.micro.harness import MODELS, make_step, script_device
from benchmarks.micro.step_phases import PERIOD, step_kinds

PARTS = (
    ("dampednewton._step.closure", "run_closure", "closure"),
    ("dampednewton.backpack.autograd_factors", "AutogradFactors._factors", "factors"),
    ("dampednewton._step.kronecker_refresh", "refreshed_layers", "refresh"),
    ("dampednewton._step.kronecker_refresh", "_averaged_batch", "refresh.average"),
    ("dampednewton.math.kronecker_factors", "FactorEigenBatch.solve", "refresh.eigh"),
    ("dampednewton.math.kronecker_rotation", "RotationBatch.solve", "rotations"),
    ("dampednewton.math.kronecker_factors", "power_rotated", "rotations.householder"),
    ("dampednewton.math.linalg", "cholesky_qr3", "rotations.cholesky_qr"),
    ("dampednewton.math.kronecker_factors", "refreshed_values", "rayleigh"),
    ("dampednewton._step.kronecker_refresh", "commit_layers", "commit"),
    ("dampednewton._step.kronecker_packed", "PackedGroup.refill", "pack.refill"),
    ("dampednewton._step.kronecker_packed", "PackedGroup.step", "pack.step"),
    ("dampednewton._step.kronecker", "KroneckerSteps.run", "kronecker"),
)
"""``(module, function or Class.method, part)``: the parts of a step, outer first."""

PREFIX = "part:"


def _ranged(function: Callable, part: str) -> Callable:
    """``function`` inside a profiler range ``part:<part>``."""

    @functools.wraps(function)
    def ranged(*args, **kwargs):
        with record_function(PREFIX + part):
            return function(*args, **kwargs)

    return ranged


@contextlib.contextmanager
def labelled_parts() -> Iterator[None]:
    """:data:`PARTS` run inside their ranges; restored on exit.

    A function is replaced wherever a module of the package imported it by name.
    """
    restore: list[tuple[object, str, object]] = []
    try:
        for module_name, qualified, part in PARTS:
            owner: object = importlib.import_module(module_name)
            *classes, name = qualified.split(".")
            for class_name in classes:
                owner = getattr(owner, class_name)
            original = vars(owner)[name]
            wrapped = _ranged(original, part)
            holders = [owner]
            if not classes:  # a function: also where it was imported by name
                holders += [
                    module
                    for key, module in list(sys.modules.items())
                    if key.startswith("dampednewton")
                    and module is not owner
                    and vars(module).get(name) is original
                ]
            for holder in holders:
                restore.append((holder, name, original))
                setattr(holder, name, wrapped)
        yield
    finally:
        for holder, name, original in reversed(restore):
            setattr(holder, name, original)


@dataclass
class PartCounts:
    """What the operators charged to one part did."""

    kernels: int = 0
    operators: int = 0
    busy: float = 0.0
    launchers: collections.Counter = field(default_factory=collections.Counter)


def _part_of(event) -> str:
    """The innermost part around a profiler event."""
    while event is not None:
        if event.name.startswith(PREFIX):
            return event.name[len(PREFIX) :]
        event = event.cpu_parent
    return "(other)"


def step_parts(
    step: Callable[[], object], device: torch.device
) -> dict[str, PartCounts]:
    """One step's operators and kernels by part (run under :func:`labelled_parts`)."""
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    synchronize(device)
    with profile(activities=activities) as profiled:
        step()
        synchronize(device)
    parts: dict[str, PartCounts] = collections.defaultdict(PartCounts)
    for event in profiled.events():
        if not event.name.startswith("aten::"):
            continue
        counts = parts[_part_of(event)]
        kernels = list(getattr(event, "kernels", []))
        counts.kernels += len(kernels)
        counts.busy += sum(kernel.duration for kernel in kernels) / 1e3
        name = event.name.removeprefix("aten::")
        if device.type == "cuda":
            counts.launchers[name] += len(kernels)
        parent = event.cpu_parent
        if parent is None or not parent.name.startswith("aten::"):
            counts.operators += 1
            if device.type != "cuda":
                counts.launchers[name] += 1
    return dict(parts)


def part_rows(model: str, batch_size: int, device: torch.device) -> list[str]:
    """Table rows of a step between refreshes and of a rotating refresh."""
    step = make_step("default", model, batch_size, device)
    kinds = step_kinds(4 * PERIOD)
    wanted = {"between", "rotating"}
    rows = []
    with warnings.catch_warnings(), labelled_parts():
        warnings.simplefilter("ignore")
        for index, kind in enumerate(kinds):
            settled = index >= 2 * PERIOD and kinds[index - 1] == "between"
            if not (settled and kind in wanted):
                step()
                continue
            wanted.discard(kind)
            parts = step_parts(step, device)
            total = PartCounts()
            for name in sorted(parts):
                counts = parts[name]
                total.kernels += counts.kernels
                total.operators += counts.operators
                total.busy += counts.busy
                top = ", ".join(
                    f"{op} {count}" for op, count in counts.launchers.most_common(4)
                )
                rows.append(
                    f"| {model} | {kind} | {name} | {counts.kernels} "
                    f"| {counts.operators} | {counts.busy:.2f} | {top} |"
                )
            rows.append(
                f"| {model} | {kind} | **step** | {total.kernels} "
                f"| {total.operators} | {total.busy:.2f} | |"
            )
            if not wanted:
                break
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """Print the table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    device, name = script_device(args.threads)
    print(f"device {name}, N={args.batch_size}, {torch.get_num_threads()} threads")
    print("| model | step | part | kernels | operators | busy ms | launchers |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for model in args.models:
        for row in part_rows(model, args.batch_size, device):
            print(row)


if __name__ == "__main__":
    main()
