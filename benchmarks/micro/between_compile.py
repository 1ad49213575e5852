"""Time the math of a step between refreshes eager, compiled and as a CUDA graph.

Between refreshes a default step runs the closure with BackPACK's hooks suspended,
then the pure math of :func:`dampednewton._step.kronecker_group.group_step` (each
layer's gradient projected on its stored eigenbases, a noise filter's moments,
the damped step and the group's slope), one host read and the update. Only that math
is a candidate for ``torch.compile``: the closure is the user's and the host read
ends any CUDA graph. This script trains the MLP 784-128-128-10 (N=128) with the
defaults by shape (``KroneckerBasis(packed=False)``, the only layout that calls
``group_step``: a packed step, the CUDA default, runs its own math, which it records
as CUDA graphs itself) past a refresh, then times, in alternating blocks on one
process (:func:`benchmarks.micro.harness.round_robin_medians`):

* ``sgd step``, ``default step`` (the device's default layout) and ``by-shape step``:
  whole training steps, for scale;
* ``math eager``: ``group_step`` on the stored bases and the last gradients;
* ``math compiled``: ``torch.compile(group_step)`` (Inductor's fused kernels);
* ``math graphs``: ``torch.compile(group_step, mode="reduce-overhead")`` (CUDA
  graphs on a GPU; on the CPU the same as ``compiled``);
* ``by-shape step, math compiled`` and ``by-shape step, math graphs``: whole training
  steps of the same model whose optimizer runs the compiled math in place of
  ``group_step`` (trained ``WARM_STEPS`` steps from the same start; a variant whose
  training fails is reported and left out), in a second table after the others.

It first checks that the compiled variants give the eager directions and, after
training, parameters near the eager run's after as many steps (taken before any
timing; float32 round-off grows over the steps), and prints each variant's first
calls (the compilation) and TorchDynamo's graph breaks.

    python -m benchmarks.micro.between_compile --threads 1
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence

import torch
from backpack import extend
from torch import nn

from benchmarks.measure import Stopwatch
from benchmarks.micro.harness import (
    MODELS,
    NUM_CLASSES,
    closure_step,
    input_shape,
    plain_step,
    round_robin_medians,
)
from dampednewton import DampedNewton, KroneckerBasis
from dampednewton._step import kronecker
from dampednewton._step.kronecker import damping_value
from dampednewton._step.kronecker_group import (
    KroneckerGroupStep,
    group_step,
    layer_batches,
)
from dampednewton._step.kronecker_moments import current_moments, group_noise_filter
from dampednewton._step.kronecker_state import stored_bases
from dampednewton._step.options import GroupOptions

WARM_STEPS = 30
"""Default steps before timing: past the first refreshes, with stored moments."""


def trained(
    model_name: str,
    batch_size: int,
    device: torch.device,
    math: Callable[..., KroneckerGroupStep] = group_step,
    packed: bool | None = False,
):
    """A DampedNewton after ``WARM_STEPS`` steps, its step and SGD's.

    The defaults, by shape unless ``packed`` says otherwise (``None``: the device's
    default layout). Its steps run ``math`` in place of ``group_step`` (eager or
    compiled); every call builds the same model, data and optimizer.
    """
    generator = torch.Generator().manual_seed(0)
    shape = (batch_size, *input_shape(model_name))
    X = torch.randn(shape, generator=generator).to(device)
    y = torch.randint(NUM_CLASSES, (batch_size,), generator=generator).to(device)
    model = extend(MODELS[model_name]().to(device))
    loss_fn = extend(nn.CrossEntropyLoss())
    basis = KroneckerBasis(packed=packed)
    optimizer = DampedNewton(model.parameters(), basis=basis, seed=0)
    step = with_math(closure_step(optimizer, model, loss_fn, X, y), math)
    for _ in range(WARM_STEPS):
        step()
    sgd_model = MODELS[model_name]().to(device)
    sgd = torch.optim.SGD(sgd_model.parameters(), lr=0.01)
    sgd_step = plain_step(sgd, sgd_model, nn.CrossEntropyLoss(), X, y)
    return optimizer, step, sgd_step


def with_math(
    step: Callable[[], object], math: Callable[..., KroneckerGroupStep]
) -> Callable[[], object]:
    """``step`` with the Kronecker step's ``group_step`` replaced by ``math``."""
    if math is group_step:
        return step

    def run() -> object:
        kronecker.group_step = math
        try:
            return step()
        finally:
            kronecker.group_step = group_step

    return run


def math_arguments(optimizer: DampedNewton) -> tuple:
    """``group_step``'s arguments from the first group's stored state."""
    group, stats = optimizer.param_groups[0], optimizer.records["groups"][0]
    options = GroupOptions.from_group(group)
    bases = stored_bases(optimizer.state, stats, group["params"])
    assert bases is not None, "no stored bases: train past the first refresh"
    noise_filter = group_noise_filter(options)
    current = noise_filter is not None and current_moments(stats)
    damping = damping_value(options)
    return (
        layer_batches(bases),
        damping,
        False,
        noise_filter,
        optimizer.state,
        current,
    )


def largest_relative_difference(
    step: KroneckerGroupStep, reference: KroneckerGroupStep
) -> float:
    """``max |s − s_ref| / max |s_ref|`` over the parameters' directions."""
    pairs = zip(step.directions, reference.directions, strict=True)
    return max(((a - b).abs().max() / b.abs().max()).item() for (_, a), (_, b) in pairs)


def parameters(optimizer: DampedNewton) -> list[torch.Tensor]:
    """Copies of the first group's parameters (a snapshot before further steps)."""
    return [p.detach().clone() for p in optimizer.param_groups[0]["params"]]


def parameter_difference(
    first: Sequence[torch.Tensor], second: Sequence[torch.Tensor]
) -> float:
    """``max |θ₁ − θ₂| / max |θ₂|`` over two lists of parameters."""
    pairs = zip(first, second, strict=True)
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in pairs)


def main(argv: Sequence[str] | None = None) -> None:
    """Print the compiled variants' agreement, compile times and medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mlp", choices=MODELS)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # Four variants compile the one function: past TorchDynamo's default of 8 cache
    # entries a variant would run eagerly, unnoticed.
    torch._dynamo.config.cache_size_limit = 64
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    optimizer, by_shape_step, sgd_step = trained(args.model, args.batch_size, device)
    eager_parameters = parameters(optimizer)  # before the timing steps it further
    _, default_step, _ = trained(args.model, args.batch_size, device, packed=None)
    arguments = math_arguments(optimizer)
    compiled = torch.compile(group_step)
    graphs = torch.compile(group_step, mode="reduce-overhead")
    variants: dict[str, Callable[[], object]] = {
        "math eager": lambda: group_step(*arguments),
        "math compiled": lambda: compiled(*arguments),
        "math graphs": lambda: graphs(*arguments),
    }
    reference = group_step(*arguments)
    for name, run in list(variants.items())[1:]:
        watch = Stopwatch(device)
        watch.start()
        for _ in range(3):  # CUDA graphs record on a later call than the first
            result = run()
        first = watch.stop()
        gap = largest_relative_difference(result, reference)  # type: ignore[arg-type]
        print(f"{name}: first 3 calls {first:.2f} s, relative difference {gap:.1e}")
    explanation = torch._dynamo.explain(group_step)(*arguments)
    print(f"TorchDynamo: {explanation.graph_count} graphs,", end=" ")
    print(f"{explanation.graph_break_count} breaks")
    scale = {
        "sgd step": sgd_step,
        "default step": default_step,
        "by-shape step": by_shape_step,
    }
    timed = {**scale, **variants}
    print_medians(timed, device, args)
    # The same training with the math compiled inside the optimizer's steps, timed
    # apart: a training that fails inside CUDA graph trees can leave them unusable
    # for the variants above (torch 2.11 on an H100).
    steps: dict[str, Callable[[], object]] = {}
    for name, mode in (("compiled", None), ("graphs", "reduce-overhead")):
        math = torch.compile(group_step, mode=mode)
        try:
            other, step, _ = trained(args.model, args.batch_size, device, math)
        except Exception as error:  # report and time the others
            print(f"training with math {name}: failed ({error!r:.300})")
            continue
        gap = parameter_difference(parameters(other), eager_parameters)
        print(f"training with math {name}: {WARM_STEPS} steps, parameters", end=" ")
        print(f"{gap:.1e} relative from eager")
        steps[f"by-shape step, math {name}"] = step
    stats = torch._dynamo.utils.counters["stats"]
    print(f"TorchDynamo compiled {stats['unique_graphs']} graphs in all")
    if steps:
        print_medians({**scale, **steps}, device, args)


def print_medians(
    timed: dict[str, Callable[[], object]],
    device: torch.device,
    args: argparse.Namespace,
) -> None:
    """Time ``timed`` in alternating blocks and print their medians against SGD's."""
    start = time.perf_counter()
    medians = round_robin_medians(timed, device, args.repeats)
    print(f"\n{args.model}, N={args.batch_size}, {device.type}", end=" ")
    print(f"({time.perf_counter() - start:.0f} s of timing)")
    print("| variant | ms | × SGD step |\n| --- | --- | --- |")
    for name, seconds in medians.items():
        ratio = seconds / medians["sgd step"]
        print(f"| {name} | {1e3 * seconds:.3f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
