"""Where a step's time goes on its device: kernels, host reads, synchronizations.

For each model, warm steps of SGD, Adam and DampedNewton are counted: ViViT's step
with top-10 directions and constant damping for each GGN (``fast:mc1``,
``fast:exact``, the Gram basis), and the package's defaults (``default``: the
Kronecker basis of the Monte-Carlo GGN, averaged and refreshed on its schedule, trust
region, on a CUDA device its layers packed and their math replayed as a CUDA graph;
``default:exact``: the same from the exact GGN; ``default:packed``: every layer in one
padded batch, not graphed; on a CUDA device also ``default:per_layer``: the layers
stepped by shape, the CPU's default). With ``--steps S`` the
counts are averaged over ``S`` consecutive steps (past ``--warmup`` steps: an
amortized step of refreshes and the steps between them):

* ``kernels``: CUDA kernels launched (``torch.profiler``); on the CPU, ATen operators
  that compute (views excluded), the proxy of launches;
* ``reads``: host reads of device values (``item``, ``tolist``, boolean masks), by
  :class:`~benchmarks.micro.host_reads.HostReads`, any device;
* ``syncs``: CUDA synchronizations that torch reports (``set_sync_debug_mode``),
  which include those of libraries such as cuSOLVER's result checks: the mean per
  step and the most in one step;
* ``busy``: the kernels' summed time on the GPU.

Step times are medians of steps timed in alternating blocks (as ``step_cost``), with
the ratio to SGD's: for the defaults, a step between refreshes. ``mean ms`` is the
mean of ``--steps`` consecutive steps after the counts, the amortized step. Not a
test: run it where the numbers are wanted::

    python -m benchmarks.micro.step_profile --models mlp 3c3d --ggn mc1 exact

``--peers soap kron`` adds the curvature peers of the sweeps.
"""

from __future__ import annotations

import argparse
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.measure import synchronize
from benchmarks.micro.harness import (
    MODELS,
    PEERS,
    check_variant,
    make_step,
    round_robin_medians,
    script_device,
    time_blocks,
)
from benchmarks.micro.host_reads import HostReads

SYNCHRONIZING = "called a synchronizing CUDA operation"
"""What torch's ``set_sync_debug_mode("warn")`` says at each synchronization."""

# ATen operators that only describe memory (no kernel on a GPU).
VIEW_OPERATORS = frozenset(
    {
        "alias",
        "as_strided",
        "detach",
        "expand",
        "lift_fresh",
        "permute",
        "reshape",
        "_reshape_alias",
        "select",
        "slice",
        "split",
        "squeeze",
        "t",
        "transpose",
        "unbind",
        "unsqueeze",
        "view",
        "_unsafe_view",
    }
)


@dataclass
class StepProfile:
    """Counts per step (averages over the counted steps, rounded).

    Attributes:
        kernels: CUDA kernels (GPU) or computing ATen operators (CPU).
        reads: Host reads of device values.
        syncs: CUDA synchronizations reported by torch, the mean per step and the
            most in one step (``None`` on the CPU).
        busy_ms: The kernels' summed GPU time (``None`` on the CPU).
    """

    kernels: int
    reads: int
    syncs: tuple[float, int] | None
    busy_ms: float | None


RECORD_FUNCTION_OPERATORS = frozenset(
    {"_record_function_enter", "_record_function_enter_new", "_record_function_exit"}
)
"""The profiler's ranges around ``Optimizer.step`` and ``zero_grad`` (no kernel)."""


def computes(func: Any) -> bool:
    """Whether an ATen operator computes: not a view, not the profiler's ranges."""
    name = func.__name__.split(".")[0]
    if name in VIEW_OPERATORS or name in RECORD_FUNCTION_OPERATORS:
        return False
    return not getattr(func, "is_view", False)


class ComputingOperators(TorchDispatchMode):
    """Counts the ATen operators that compute (:func:`computes`)."""

    def __init__(self) -> None:
        """Start at zero."""
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Count ``func`` if it computes, then run it."""
        if computes(func):
            self.count += 1
        return func(*args, **(kwargs or {}))


class EigensolverCalls(TorchDispatchMode):
    """Counts the symmetric eigensolver's calls (``eigh``, ``eigvalsh``).

    On CUDA each call synchronizes once, to check its result.
    """

    def __init__(self) -> None:
        """Start at zero."""
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Count ``func`` if it is the eigensolver, then run it."""
        self.count += func.overloadpacket is torch.ops.aten._linalg_eigh
        return func(*args, **(kwargs or {}))


def cuda_kernels(run: Callable[[], object], device: torch.device) -> tuple[int, float]:
    """The CUDA kernels ``run()`` launches and their summed GPU time in ms.

    Args:
        run: The work to profile (it ends with the device synchronized).
        device: A CUDA device.

    Returns:
        ``(kernels, busy ms)``.
    """
    with profile(activities=[ProfilerActivity.CUDA]) as profiler:
        run()
        synchronize(device)
    kernels = [
        event
        for event in profiler.events()
        if event.device_type == torch.autograd.DeviceType.CUDA
    ]
    return len(kernels), sum(event.device_time for event in kernels) / 1e3


def profile_step(
    step: Callable[[], object], device: torch.device, steps: int = 1
) -> StepProfile:
    """Count a (warm) step's kernels, host reads and synchronizations.

    Args:
        step: One optimizer step (model, data and closure inside).
        device: Where it runs.
        steps: Average the counts over this many consecutive steps (an amortized
            step: refreshes and the steps between them; the default's pattern
            repeats every 45 steps, three refreshes of which one rotates). On the
            CPU the reads and operators are counted on the same steps.

    Returns:
        The counts per step.
    """
    synchronize(device)
    if device.type != "cuda":  # reads and operators of the same steps
        with HostReads() as reads, ComputingOperators() as operators:
            for _ in range(steps):
                step()
        return StepProfile(
            round(operators.count / steps),
            round(sum(reads.counts.values()) / steps),
            None,
            None,
        )
    with HostReads() as reads:
        for _ in range(steps):
            step()
    synchronize(device)
    per_step = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                before = len(caught)
                step()
                # torch's first warning in a process is a notice that the mode is a
                # prototype.
                new = caught[before:]
                per_step.append(sum(SYNCHRONIZING in str(w.message) for w in new))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    synchronize(device)
    launched, busy_ms = cuda_kernels(lambda: [step() for _ in range(steps)], device)
    busy = busy_ms / steps
    return StepProfile(
        round(launched / steps),
        round(sum(reads.counts.values()) / steps),
        (sum(per_step) / steps, max(per_step)),
        busy,
    )


def table(
    models: Sequence[str],
    ggns: Sequence[str],
    batch_size: int,
    device: torch.device,
    repeats: int,
    warmup: int = 3,
    steps: int = 1,
    peers: Sequence[str] = (),
    chosen: Sequence[str] = (),
) -> list[str]:
    """Markdown rows of every model, GGN and variant (SGD and Adam first).

    Args:
        models: Names in :data:`benchmarks.micro.harness.MODELS`.
        ggns: ``mc1`` and/or ``exact``.
        batch_size: ``N``.
        device: Where to run.
        repeats: Timed steps per variant (rounded up to a multiple of the 8
            alternating rounds).
        warmup: Steps of each variant before timing and counting.
        steps: Steps the counts are averaged over (see :func:`profile_step`).
        peers: Curvature peers to add (``soap``, ``kron``: :data:`PEERS`).
        chosen: The variants to profile, in this order, in place of SGD, Adam, the
            peers, the ViViT steps and the defaults' layouts (``sgd`` among them:
            the ratios are to its step).

    Returns:
        The table's lines.

    Raises:
        ValueError: For ``chosen`` variants without ``sgd``.
    """
    if chosen and "sgd" not in chosen:
        raise ValueError("Profile sgd among the chosen variants: the ratios are to it.")
    kernels = "kernels" if device.type == "cuda" else "ATen ops"
    lines = [
        f"| model | variant | ms | ×SGD | {kernels} | host reads | syncs: mean / most "
        "| busy ms | mean ms | mean ×SGD |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for model in models:
        variants = (
            list(chosen)
            if chosen
            else [
                "sgd",
                "adam",
                *peers,
                *(f"fast:{ggn}" for ggn in ggns),
                "default",
                *(["default:per_layer"] if device.type == "cuda" else []),
                "default:packed",
                *(["default:exact"] if "exact" in ggns else []),
            ]
        )
        step_of = {v: make_step(v, model, batch_size, device) for v in variants}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for step in step_of.values():
                for _ in range(warmup):
                    step()
            seconds = round_robin_medians(step_of, device, repeats)
            profiles = {
                v: profile_step(step, device, steps=steps)
                for v, step in step_of.items()
            }
            # ``steps`` consecutive steps each: the amortized step's mean.
            runs = time_blocks(step_of, device, rounds=1, warmup=0, repeats=steps)
        means = {v: statistics.fmean(times) for v, times in runs.items()}
        for variant in variants:
            counts = profiles[variant]
            lines.append(
                f"| {model} | {variant} | {1e3 * seconds[variant]:.2f} "
                f"| {seconds[variant] / seconds['sgd']:.1f}× | {counts.kernels} "
                f"| {counts.reads} | {_syncs(counts.syncs)} "
                f"| {_optional(counts.busy_ms, '.2f')} | {1e3 * means[variant]:.2f} "
                f"| {means[variant] / means['sgd']:.1f}× |"
            )
    return lines


def _syncs(syncs: tuple[float, int] | None) -> str:
    return "—" if syncs is None else f"{syncs[0]:.2f} / {syncs[1]}"


def _optional(value: float | None, spec: str = "") -> str:
    return "—" if value is None else format(value, spec)


def main(argv: Sequence[str] | None = None) -> None:
    """Print the profile table (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["mlp"], choices=MODELS)
    parser.add_argument(
        "--ggn", nargs="+", default=["mc1", "exact"], choices=["mc1", "exact"]
    )
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=16)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--warmup", type=int, default=3, help="steps of each variant first"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=1,
        help="average the counts over this many steps (amortized refreshes)",
    )
    parser.add_argument(
        "--peers",
        nargs="*",
        default=[],
        choices=PEERS,
        help="curvature peers to add (pytorch-optimizer, the bench extra)",
    )
    parser.add_argument(
        "--variants",
        nargs="*",
        default=[],
        help="profile these variants only (sgd among them; harness.make_step's "
        "names, e.g. sgd adam default default:interval30)",
    )
    args = parser.parse_args(argv)
    if args.variants and "sgd" not in args.variants:
        parser.error("--variants needs sgd among them: the ratios are to its step.")
    for variant in args.variants:
        kind, _, ggn = variant.partition(":")
        check_variant(kind, ggn)
    device, name = script_device(args.threads)
    print(f"device {name}, N={args.batch_size}, {torch.get_num_threads()} threads")
    lines = table(
        args.models,
        args.ggn,
        args.batch_size,
        device,
        args.repeats,
        warmup=args.warmup,
        steps=args.steps,
        peers=args.peers,
        chosen=args.variants,
    )
    for line in lines:
        print(line)


if __name__ == "__main__":
    main()
