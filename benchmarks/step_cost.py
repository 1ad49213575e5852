"""Cost of one damped Newton step relative to one SGD step (not a test).

For each model, GGN variant (exact, MC-1) and batch size, prints in one process the
median wall time of an SGD step (forward, backward, update), of ``DampedNewton.step``
with ViViT's step (the fast, structured path; top-10, constant damping), of the
materialized path (BackPACK's dense square roots and individual gradients, as in
ViViT), and of ``DampedNewton`` with the package's defaults (MC-1 GGN averaged across
steps, top-20, complement, trust region), and their ratios to SGD. With
``--memory``, each variant also runs in a fresh process that reports its peak memory
(growth of the resident-set peak during the steps on CPU,
``torch.cuda.max_memory_allocated`` on GPU).

    python -m benchmarks.step_cost                       # MLP and CNN, N=128
    python -m benchmarks.step_cost --models mlp mlp-large cnn --batch-sizes 32 128 512
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping

import torch
from backpack import backpack, extend
from torch import nn

from benchmarks.models import cifar10_3c3d, mlp
from dampednewton import DampedNewton, DirectionalDampedNewtonComputation

NUM_CLASSES = 10
DIRECTIONS = 10
NOT_RUN = "—"  # the cells of the materialized path under --skip-materialized


def flat_mlp(hidden: tuple[int, ...]) -> Callable[[], nn.Module]:
    """Factory of a ReLU MLP 784-hidden-10 on flattened 28×28 inputs."""

    def build() -> nn.Module:
        generator = torch.Generator().manual_seed(0)
        return nn.Sequential(
            nn.Flatten(), mlp(784, hidden, NUM_CLASSES, "relu", generator=generator)
        )

    return build


def cnn() -> nn.Module:
    """conv(16,5)-pool-conv(32,5)-pool-fc128-fc10 on 1×28×28 inputs."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 128),
        nn.ReLU(),
        nn.Linear(128, NUM_CLASSES),
    )


def deepobs_3c3d() -> nn.Module:
    """DeepOBS's cifar10_3c3d (ViViT's memory benchmark) on 3×32×32 inputs."""
    return cifar10_3c3d(NUM_CLASSES, generator=torch.Generator().manual_seed(0))


MODELS: dict[str, Callable[[], nn.Module]] = {
    "mlp": flat_mlp((128, 128)),
    "mlp-large": flat_mlp((512, 512)),
    "cnn": cnn,
    "3c3d": deepobs_3c3d,
}
INPUT_SHAPES: dict[str, tuple[int, ...]] = {"3c3d": (3, 32, 32)}
"""A model's input shape, where it is not 1×28×28."""


def input_shape(model_name: str) -> tuple[int, ...]:
    """The shape of one input of a model of :data:`MODELS`."""
    return INPUT_SHAPES.get(model_name, (1, 28, 28))


def synchronize(device: torch.device) -> None:
    """Wait for queued GPU work so wall times are honest."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def round_robin_medians(
    steps: Mapping[str, Callable[[], object]],
    device: torch.device,
    repeats: int,
    rounds: int = 8,
) -> dict[str, float]:
    """Median seconds per step of each variant, timed in alternating blocks.

    Every round runs each variant for one untimed warm-up step and then
    ``⌈repeats / rounds⌉`` timed steps in a row, as in a training loop (warm caches);
    the rounds expose all variants to the same slow phases of a shared machine.
    """
    per_round = -(-repeats // rounds)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            step()
            for _ in range(per_round):
                synchronize(device)
                start = time.perf_counter()
                step()
                synchronize(device)
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def make_step(variant: str, model_name: str, batch_size: int, device: torch.device):
    """Build model, data and a closure-driven step for one variant."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # benchmark script: module initialization only
    model = MODELS[model_name]().to(device)
    loss_fn = nn.CrossEntropyLoss()
    X = torch.randn(batch_size, *input_shape(model_name), generator=generator)
    X = X.to(device)
    y = torch.randint(NUM_CLASSES, (batch_size,), generator=generator).to(device)
    kind, _, ggn = variant.partition(":")
    mc_samples = 1 if ggn == "mc1" else 0
    if kind in ("sgd", "adam"):
        plain = (
            torch.optim.SGD(model.parameters(), lr=1e-3)
            if kind == "sgd"
            else torch.optim.Adam(model.parameters(), lr=1e-3)
        )

        def step() -> None:
            plain.zero_grad()
            loss_fn(model(X), y).backward()
            plain.step()

        return step
    model, loss_fn = extend(model), extend(loss_fn)
    if kind in ("fast", "default"):
        vivit = {
            "damping": 1e-2,
            "criterion": DIRECTIONS,
            "mc_samples": mc_samples,
            "complement": None,
            "newton_fraction": 1.0,
            "averaging": None,
            "kl_clip": None,
        }
        settings = {"seed": 0} if kind == "default" else vivit
        optimizer = DampedNewton(model.parameters(), lr=1e-3, **settings)

        def closure() -> torch.Tensor:
            optimizer.zero_grad()
            loss = loss_fn(model(X), y)
            loss.backward()
            return loss

        return lambda: optimizer.step(closure)
    params = list(model.parameters())
    group = {"params": params, "criterion": DIRECTIONS, "damping": 1e-2}

    def materialized_step() -> None:
        computation = DirectionalDampedNewtonComputation(
            mc_samples_ggn=mc_samples, structured=False
        )
        hook = computation.get_extension_hook([group])
        for p in params:
            p.grad = None
        with backpack(*computation.get_extensions(), extension_hook=hook):
            loss_fn(model(X), y).backward()
        with torch.no_grad():
            for p, s in zip(params, computation.get_result(group), strict=True):
                p.add_(s, alpha=1e-3)

    return materialized_step


def peak_memory_mib(variant, model_name, batch_size, device_name) -> float:
    """Peak memory of one variant, measured in a fresh process."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.step_cost",
        "--single",
        variant,
        model_name,
    ]
    command += [str(batch_size), device_name]
    output = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(output.stdout.strip().splitlines()[-1])["peak_mib"]


def run_single(variant, model_name, batch_size, device_name) -> None:
    """Entry point of the fresh process: run a few steps, print the peak memory.

    On CPU the peak is the growth of the resident-set high-water mark over the
    process's state after building model and data (``ru_maxrss`` also counts the
    Python and torch libraries); on GPU it is ``torch.cuda.max_memory_allocated``.
    """
    device = torch.device(device_name)
    step = make_step(variant, model_name, batch_size, device)
    baseline = resident_peak_mib()
    for _ in range(3):
        step()
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 2**20
    else:
        peak = resident_peak_mib() - baseline
    print(json.dumps({"peak_mib": peak}))


def resident_peak_mib() -> float:
    """This process's resident-set high-water mark in MiB.

    Linux's ``VmHWM`` belongs to the process image; ``ru_maxrss`` would also carry
    the parent's peak across ``exec`` (the benchmark's own large variants).
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**10
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10


def main() -> None:
    """Print the step-cost table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp", "cnn"], choices=MODELS)
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[128])
    parser.add_argument("--ggn", nargs="+", default=["mc1", "exact"])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--skip-materialized", action="store_true")
    parser.add_argument("--memory", action="store_true", help="peak memory per variant")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--single", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.single:
        variant, model_name, batch_size, device_name = args.single
        run_single(variant, model_name, int(batch_size), device_name)
        return
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    print(f"device {device}, {torch.get_num_threads()} threads, top-{DIRECTIONS}")
    header = f"{'model':10} {'N':>4} {'GGN':>5} {'SGD ms':>8} {'fast ms':>8} "
    header += f"{'fast/SGD':>9} {'dense ms':>9} {'dense/SGD':>10}"
    header += f" {'default ms':>11} {'default/SGD':>12}"
    if args.memory:
        header += f" {'SGD MiB':>8} {'fast MiB':>9} {'dense MiB':>10}"
    print(header)
    for model_name in args.models:
        for batch_size in args.batch_sizes:
            for ggn in args.ggn:
                variants = ["sgd", f"fast:{ggn}", "default"]
                variants += [] if args.skip_materialized else [f"dense:{ggn}"]
                times = round_robin_medians(
                    {v: make_step(v, model_name, batch_size, device) for v in variants},
                    device,
                    args.repeats,
                )
                sgd = times["sgd"]
                fast = times[f"fast:{ggn}"]
                default = times["default"]
                dense = times.get(f"dense:{ggn}")
                dense_cells = (
                    f"{NOT_RUN:>9} {NOT_RUN:>10}"
                    if dense is None
                    else f"{dense * 1e3:9.1f} {dense / sgd:9.1f}×"
                )
                line = (
                    f"{model_name:10} {batch_size:>4} {ggn:>5} {sgd * 1e3:8.2f} "
                    f"{fast * 1e3:8.1f} {fast / sgd:8.1f}× {dense_cells} "
                    f"{default * 1e3:11.1f} {default / sgd:11.1f}×"
                )
                if args.memory:
                    sgd_mib, fast_mib, *dense_mib = (
                        peak_memory_mib(v, model_name, batch_size, device.type)
                        for v in variants
                        if v != "default"
                    )
                    dense_memory = f"{dense_mib[0]:10.0f}" if dense_mib else NOT_RUN
                    line += f" {sgd_mib:8.0f} {fast_mib:9.0f} {dense_memory:>10}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
