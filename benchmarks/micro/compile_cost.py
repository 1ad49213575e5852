"""Time a DampedNewton step with and without ``torch.compile(model)`` (not a test).

BackPACK's ``extend`` registers module backward hooks, and TorchDynamo breaks the
graph at every module with such hooks ("Module-level backwards hooks require compiled
autograd"), so the compiled model runs as a chain of small graphs. This script
times, in one process and alternating blocks (``harness.round_robin_medians``),
steps of ``DampedNewton`` (its defaults) or SGD on the MLP 784-128-128-10 with
N=128, with and without ``torch.compile`` of the model, after comparing their
parameters after one step; it reports the first compiled step (compilation) and the
graphs TorchDynamo makes of the model (``torch._dynamo.explain``).

Run each optimizer in its own process: TorchDynamo does not guard on module hooks
(``torch._dynamo.config.skip_nnmodule_hook_guards``), so a graph compiled for a
plain model of a class is reused for an extended one, skipping BackPACK's hooks.

    python -m benchmarks.micro.compile_cost --threads 1
    python -m benchmarks.micro.compile_cost --threads 1 --optimizer sgd
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from backpack import extend
from torch import nn

from benchmarks.micro.harness import (
    MODELS,
    NUM_CLASSES,
    input_shape,
    round_robin_medians,
)
from dampednewton import DampedNewton

OPTIMIZERS = ("dampednewton", "sgd")


def make_step(
    optimizer_name: str, compiled: bool, batch_size: int, model_name: str
) -> tuple[Callable[[], object], nn.Module]:
    """A training step, and its (uncompiled) model."""
    generator = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # benchmark script: module initialization only
    model = MODELS[model_name]()
    X = torch.randn(batch_size, *input_shape(model_name), generator=generator)
    y = torch.randint(NUM_CLASSES, (batch_size,), generator=generator)
    loss_fn = nn.CrossEntropyLoss()
    if optimizer_name == "dampednewton":
        model, loss_fn = extend(model), extend(loss_fn)
        optimizer: torch.optim.Optimizer = DampedNewton(model.parameters(), seed=0)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = torch.compile(model) if compiled else model

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = loss_fn(forward(X), y)
        loss.backward()
        return loss

    # torch's stub types closures as returning float; they may return the loss Tensor.
    return lambda: optimizer.step(closure), model  # type: ignore[arg-type]


def main() -> None:
    """Print the graph count, the compilation time and the per-step medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", default="dampednewton", choices=OPTIMIZERS)
    parser.add_argument("--model", default="mlp", choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=24)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    steps, models = {}, {}
    for compiled in (False, True):
        name = "compiled" if compiled else "eager"
        steps[name], models[name] = make_step(
            args.optimizer, compiled, args.batch_size, args.model
        )
        start = time.perf_counter()
        steps[name]()
        print(f"{name:8} first step {time.perf_counter() - start:7.2f} s")
    difference = max(
        ((a - b).abs().max() / a.abs().max()).item()
        for a, b in zip(
            models["eager"].parameters(), models["compiled"].parameters(), strict=True
        )
    )
    print(f"parameters after one step, compiled vs eager: {difference:.1e} apart")
    explained = torch._dynamo.explain(models["eager"])(
        torch.randn(args.batch_size, *input_shape(args.model))
    )
    print(
        f"{args.model} as {args.optimizer} sees it: {explained.graph_count} graphs, "
        f"{explained.graph_break_count} graph breaks"
    )
    times = round_robin_medians(steps, torch.device("cpu"), args.repeats)
    eager_ms, compiled_ms = times["eager"] * 1e3, times["compiled"] * 1e3
    print(
        f"{torch.get_num_threads()} threads, N={args.batch_size}, median ms/step: "
        f"{args.optimizer} eager {eager_ms:.3f}, compiled {compiled_ms:.3f}, "
        f"compiled/eager {compiled_ms / eager_ms:.2f}"
    )


if __name__ == "__main__":
    main()
