"""The largest batch whose step fits under a GPU memory cap (ViViT's critical batch).

Each trial runs one step of a variant of :func:`benchmarks.micro.harness.make_step`
(``fast:exact``, ``fast:mc1``, ``sgd``, ``default``) at batch size ``N`` in a fresh
process whose CUDA memory is capped by ``torch.cuda.set_per_process_memory_fraction``;
the batch size doubles until a step runs out of memory, then bisects to
``--resolution``. ViViT reported 208 (exact) and 1,055 (MC-1) for DeepOBS's
cifar10_3c3d on an 11 GB card. Needs CUDA. Not a test::

    python -m benchmarks.micro.critical_batch --variants fast:exact fast:mc1  # 3c3d
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence

import torch

from benchmarks.measure import synchronize
from benchmarks.micro.harness import MODELS, make_step

OUT_OF_MEMORY = 3
"""Exit status of a trial whose step ran out of memory."""


def largest_fitting(fits: Callable[[int], bool], start: int, resolution: int) -> int:
    """The largest multiple of ``resolution`` for which ``fits`` holds (0 if none).

    Doubles from ``start`` until ``fits`` fails, then bisects; assumes that what
    fits at ``N`` fits at every smaller ``N``.

    Args:
        fits: Whether a batch size fits.
        start: First batch size tried (a multiple of ``resolution``).
        resolution: Granularity of the answer.

    Returns:
        The largest fitting multiple of ``resolution`` found.
    """
    if start % resolution:
        raise ValueError(f"start={start} is not a multiple of resolution={resolution}")
    low, high = 0, start
    while fits(high):
        low, high = high, 2 * high
    while high - low > resolution:
        middle = (low + high) // 2 // resolution * resolution
        if fits(middle):
            low = middle
        else:
            high = middle
    return low


def trial(variant: str, model: str, batch_size: int, cap_gib: float) -> bool:
    """Whether one step fits under the cap, run in a fresh process.

    Args:
        variant: A :func:`benchmarks.micro.harness.make_step` variant.
        model: A model of :data:`benchmarks.micro.harness.MODELS`.
        batch_size: ``N``.
        cap_gib: The memory cap in GiB.

    Returns:
        ``False`` when the step ran out of memory.

    Raises:
        RuntimeError: When the trial failed otherwise.
    """
    command = [sys.executable, "-m", "benchmarks.micro.critical_batch", "--single"]
    command += [variant, model, str(batch_size), str(cap_gib)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode == OUT_OF_MEMORY:
        return False
    if done.returncode:
        raise RuntimeError(f"trial {command} failed:\n{done.stderr[-2000:]}")
    return True


def _single(variant: str, model: str, batch_size: int, cap_gib: float) -> None:
    """One capped step in this process: exit 0 if it fits, else ``OUT_OF_MEMORY``."""
    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * 2**30 / total))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            make_step(variant, model, batch_size, device)()
        synchronize(device)
    except torch.cuda.OutOfMemoryError:
        sys.exit(OUT_OF_MEMORY)


def main(argv: Sequence[str] | None = None) -> None:
    """Print each variant's critical batch (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="3c3d", choices=MODELS)
    parser.add_argument("--variants", nargs="+", default=["fast:exact", "fast:mc1"])
    parser.add_argument("--cap-gib", type=float, default=11.0)
    parser.add_argument("--start", type=int, default=64)
    parser.add_argument("--resolution", type=int, default=16)
    parser.add_argument("--single", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.single:
        variant, model, batch_size, cap_gib = args.single
        _single(variant, model, int(batch_size), float(cap_gib))
        return
    if not torch.cuda.is_available():
        sys.exit("critical_batch needs CUDA: it caps the memory of a CUDA device.")
    name = torch.cuda.get_device_name()
    print(f"device {name}, model {args.model}, cap {args.cap_gib} GiB")
    print("| variant | critical batch |\n| --- | --- |")
    for variant in args.variants:
        found = largest_fitting(
            functools.partial(trial, variant, args.model, cap_gib=args.cap_gib),
            args.start,
            args.resolution,
        )
        print(f"| {variant} | {found} |", flush=True)


if __name__ == "__main__":
    main()
