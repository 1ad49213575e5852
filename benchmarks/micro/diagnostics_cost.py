"""Cost of the diagnostics: median step time of SGD and DampedNewton with and without.

Problem: MLP 784-128-128-10 (ReLU), cross-entropy, N = 128 random inputs and labels
(float32). A step is ``zero_grad`` + forward + backward + ``optimizer.step()``;
with diagnostics the backward runs inside ``monitor.backward_context(step, loss)``,
which finishes the record on exit (record to CPU, appended to the log).
The baseline is SGD on the plain, non-extended model. Variants are timed in
alternating blocks of consecutive steps (robust to a shared machine's changing
load); the script prints the median and the minimum per variant and their ratios
to plain SGD, then the ratio of each ``DampedNewton`` step with GSNR (computed in the
same backward pass, ``DampedNewton(monitor=...)``) to the same step without.

Usage::

    python -m benchmarks.micro.diagnostics_cost [--rounds 3] [--repeats 10] [--warmup 2]
        [--device cpu] [--threads 1]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
from collections.abc import Callable

import torch
from backpack import extend
from torch import nn

from benchmarks.micro.harness import closure_step, plain_step, time_blocks
from dampednewton import DampedNewton
from dampednewton.diagnostics import (
    GSNR,
    CurvatureTrace,
    DiagnosticsMonitor,
    GradientHistogram,
    GradientParameterHistogram,
    NoiseScale,
)

BATCH_SIZE = 128
LAYERS = (784, 128, 128, 10)


def make_model(device: torch.device, seed: int = 0) -> nn.Module:
    """MLP with ReLU activations, parameters drawn from a local generator."""
    generator = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = []
    for fan_in, fan_out in itertools.pairwise(LAYERS):
        linear = nn.Linear(fan_in, fan_out)
        with torch.no_grad():
            for param in linear.parameters():
                param.copy_(torch.randn(param.shape, generator=generator) / fan_in**0.5)
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers[:-1]).to(device)


def make_data(device: torch.device, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and labels."""
    generator = torch.Generator().manual_seed(seed)
    X = torch.randn(BATCH_SIZE, LAYERS[0], generator=generator)
    y = torch.randint(0, LAYERS[-1], (BATCH_SIZE,), generator=generator)
    return X.to(device), y.to(device)


def step_function(device: torch.device, diagnostics: list | None) -> Callable[[], None]:
    """One training step, optionally monitored by ``diagnostics``."""
    X, y = make_data(device)
    model = make_model(device)
    loss_fn = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    if diagnostics is None:
        return plain_step(optimizer, model, loss_fn, X, y)
    model, loss_fn = extend(model), extend(loss_fn)
    monitor = DiagnosticsMonitor(diagnostics, model.named_parameters())
    step_numbers = itertools.count()

    def monitored_step() -> None:
        optimizer.zero_grad()
        loss = loss_fn(model(X), y)
        with monitor.backward_context(next(step_numbers), loss):
            loss.backward()
        optimizer.step()

    return monitored_step


def newton_step_function(
    device: torch.device, mc_samples: int, diagnostics: list | None
) -> Callable[[], object]:
    """One ``DampedNewton`` step (defaults, constant damping), optionally monitored."""
    X, y = make_data(device)
    model, loss_fn = extend(make_model(device)), extend(nn.CrossEntropyLoss())
    monitor = (
        None
        if diagnostics is None
        else DiagnosticsMonitor(diagnostics, model.named_parameters())
    )
    optimizer = DampedNewton(
        model.parameters(),
        lr=1e-3,
        damping=1e-2,
        mc_samples=mc_samples,
        monitor=monitor,
        seed=0,
    )
    return closure_step(optimizer, model, loss_fn, X, y)


VARIANTS: dict[str, list | None] = {
    "sgd": None,
    "sgd + gsnr": [GSNR()],
    "sgd + gsnr + noise scale": [GSNR(), NoiseScale()],
    "sgd + 1d histograms": [GradientHistogram()],
    "sgd + 1d + 2d histograms": [GradientHistogram(), GradientParameterHistogram()],
    "sgd + trace (diag_ggn_mc)": [CurvatureTrace(curvature="diag_ggn_mc")],
}


NEWTON_VARIANTS = {"dampednewton mc1": 1, "dampednewton exact": 0}


def main() -> None:
    """Measure every variant and print median/min times and ratios to plain SGD."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"MLP {'-'.join(map(str, LAYERS))}, N={BATCH_SIZE}, cross-entropy, "
        f"device={device}, threads={torch.get_num_threads()}, "
        f"{args.rounds} rounds of {args.repeats} timed steps per variant "
        f"(after {args.warmup} untimed)"
    )
    steps: dict[str, Callable[[], object]] = {
        name: step_function(device, spec) for name, spec in VARIANTS.items()
    }
    for label, mc_samples in NEWTON_VARIANTS.items():
        steps[label] = newton_step_function(device, mc_samples, None)
        steps[f"{label} + gsnr"] = newton_step_function(device, mc_samples, [GSNR()])
    times = time_blocks(steps, device, args.rounds, args.warmup, args.repeats)
    median = {name: statistics.median(values) for name, values in times.items()}
    fastest = {name: min(values) for name, values in times.items()}
    print(f"{'variant':28s} {'median':>10s} {'ratio':>7s} {'min':>10s} {'ratio':>7s}")
    for name in steps:
        median_ratio = median[name] / median["sgd"]
        fastest_ratio = fastest[name] / fastest["sgd"]
        print(
            f"{name:28s} {median[name] * 1e3:8.2f}ms {median_ratio:7.2f}"
            f" {fastest[name] * 1e3:8.2f}ms {fastest_ratio:7.2f}"
        )
    for label in NEWTON_VARIANTS:
        with_gsnr = f"{label} + gsnr"
        print(
            f"{with_gsnr} / {label}: median {median[with_gsnr] / median[label]:.2f}×, "
            f"min {fastest[with_gsnr] / fastest[label]:.2f}× (target ≤ 1.3×)"
        )


if __name__ == "__main__":
    main()
