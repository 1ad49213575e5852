"""Per-step time with torch's default thread count vs the bounded small-matrix solves.

Three variants of the same ``DampedNewton.step``, timed in one process in
alternating blocks of consecutive steps (``harness.round_robin_medians``):

* ``default``: torch's default intra-op thread count everywhere (one per core),
  small eigenproblems included (``dampednewton.threads.SMALL_MATRIX_THREADS = None``);
* ``helper``: the package's default: the same thread count, but the Gram matrices'
  eigendecompositions (up to ``SMALL_MATRIX_SIZE`` rows) on one thread;
* ``one-thread``: ``torch.set_num_threads(1)`` for the whole step (the Hydra
  benchmark's ``num_threads: 1``).

Settings: the package's defaults, ViViT's step on the MC-1 and on the exact GGN, and
``gram-eigh``, the eigendecomposition of an N×N Gram matrix alone.

``--busy K`` starts K busy-looping processes for the duration, to measure a loaded
machine reproducibly (the case that motivated the bound: all cores busy with other
work). Prints median milliseconds per step and the ratios to ``helper``.

    python -m benchmarks.micro.cpu_threads             # as the machine is
    python -m benchmarks.micro.cpu_threads --busy 2    # two cores' worth of other work
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from backpack import extend
from torch import nn

from benchmarks.micro.harness import (
    MODELS,
    NUM_CLASSES,
    closure_step,
    input_shape,
    round_robin_medians,
)
from dampednewton import DampedNewton, GramBasis, threads
from dampednewton.math.linalg import symmetric_eigh

SETTINGS: dict[str, dict[str, Any]] = {
    # The package's defaults: the Kronecker basis, factors of the MC-1 GGN averaged
    # across steps and refreshed on a schedule.
    "defaults": {},
    # ViViT's step (top-10 of the Gram basis) on this batch's MC-1 GGN (Gram N×N).
    "vivit-mc1": {
        "basis": GramBasis(),
        "criterion": 10,
        "averaging": None,
        "complement": None,
        "newton_fraction": 1.0,
        "kl_clip": None,
    },
    # ViViT's step on the exact GGN (Gram N·C × N·C, above SMALL_MATRIX_SIZE at N=128).
    "vivit-exact": {
        "basis": GramBasis(),
        "criterion": 10,
        "averaging": None,
        "complement": None,
        "newton_fraction": 1.0,
        "kl_clip": None,
        "mc_samples": 0,
    },
}
GRAM_EIGH = "gram-eigh"
"""Not a step: only the eigendecomposition of an N×N Gram matrix."""
VARIANTS = ("default", "helper", "one-thread")


def make_step(model_name: str, setting: str, batch_size: int) -> Callable[[], object]:
    """A DampedNewton step (closure included) on random data, or the Gram's eigh."""
    generator = torch.Generator().manual_seed(0)
    if setting == GRAM_EIGH:
        factor = torch.randn(batch_size, 2 * batch_size, generator=generator)
        gram = factor @ factor.T
        return lambda: symmetric_eigh(gram)
    torch.manual_seed(0)  # benchmark script: module initialization only
    model = extend(MODELS[model_name]())
    loss_fn = extend(nn.CrossEntropyLoss())
    X = torch.randn(batch_size, *input_shape(model_name), generator=generator)
    y = torch.randint(NUM_CLASSES, (batch_size,), generator=generator)
    optimizer = DampedNewton(model.parameters(), lr=1e-3, seed=0, **SETTINGS[setting])
    return closure_step(optimizer, model, loss_fn, X, y)


def in_variant(variant: str, step: Callable[[], object]) -> Callable[[], None]:
    """The step run under a variant's thread settings (restored afterwards)."""
    default_threads = torch.get_num_threads()

    def run() -> None:
        bound = threads.SMALL_MATRIX_THREADS
        threads.SMALL_MATRIX_THREADS = None if variant == "default" else bound
        torch.set_num_threads(1 if variant == "one-thread" else default_threads)
        try:
            step()
        finally:
            threads.SMALL_MATRIX_THREADS = bound
            torch.set_num_threads(default_threads)

    return run


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """Run ``count`` busy-looping Python processes while the block runs."""
    processes = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(count)
    ]
    try:
        yield
    finally:
        for process in processes:
            process.kill()
            process.wait()


def main() -> None:
    """Print the per-step medians of the three variants and their ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=MODELS)
    parser.add_argument(
        "--settings",
        nargs="+",
        default=[GRAM_EIGH, *SETTINGS],
        choices=[GRAM_EIGH, *SETTINGS],
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=24)
    parser.add_argument("--busy", type=int, default=0, help="busy processes")
    args = parser.parse_args()
    print(
        f"{torch.get_num_threads()} threads by default, small-matrix bound "
        f"{threads.SMALL_MATRIX_THREADS} thread(s) up to {threads.SMALL_MATRIX_SIZE} "
        f"rows, {args.busy} busy processes, N={args.batch_size}"
    )
    print(
        f"{'model':6} {'setting':12} {'default ms':>11} {'helper ms':>10} "
        f"{'1 thread ms':>12} {'default/helper':>15} {'1 thread/helper':>16}"
    )
    with busy_processes(args.busy):
        for model_name in args.models:
            for setting in args.settings:
                step = make_step(model_name, setting, args.batch_size)
                times = round_robin_medians(
                    {v: in_variant(v, step) for v in VARIANTS},
                    torch.device("cpu"),
                    args.repeats,
                )
                default, helper, single = (times[v] * 1e3 for v in VARIANTS)
                shown = "-" if setting == GRAM_EIGH else model_name
                print(
                    f"{shown:6} {setting:12} {default:11.1f} {helper:10.1f} "
                    f"{single:12.1f} {default / helper:14.2f}× "
                    f"{single / helper:15.2f}×"
                )


if __name__ == "__main__":
    main()
