"""Data-parallel scaling of DampedNewton on CPU (gloo), and its cost model on paper.

Measured (default): for each problem and world size, spawns that many gloo ranks
(1 thread each) that train the problem's model (float32, DDP, the package's
defaults; ``benchmarks.scaling.scaling_worker``) for a few warm-up and timed steps, and
prints per problem and GGN (MC-1, exact): median ms/step, DampedNewton's ms/step in
its collectives, the bytes rank 0 received per step in them (measured, and the cost
model's prediction), the bytes DDP's gradient all-reduce received (measured bucket
sizes, ring traffic ``2 (R − 1)/R``), their ratio, SGD's and Adam's ms/step under
DDP and DampedNewton's time over SGD's. Strong scaling (fixed global batch) by
default; ``--weak`` fixes the local batch instead.

``--extrapolate`` prints the cost model (:mod:`benchmarks.scaling.communication_model`)
for 1–64 GPUs instead: nothing is run.

    python -m benchmarks.scaling.scaling                # ~3 min on 2 cores
    python -m benchmarks.scaling.scaling --problems mnist1d_mlp --world-sizes 1 2
    python -m benchmarks.scaling.scaling --extrapolate  # fmnist_2c2d, MC-1
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from hydra.utils import instantiate
from omegaconf import OmegaConf

from benchmarks.scaling.communication_model import (
    FIXED_COLLECTIVES,
    FLOAT32_BYTES,
    INFINIBAND,
    NVLINK,
    all_gather_seconds,
    all_reduce_bytes,
    all_reduce_seconds,
    dampednewton_bytes,
    ddp_buckets,
    gathered_layout,
    gram_growth,
    kronecker_bytes,
    kronecker_numbers,
)
from benchmarks.scaling.scaling_worker import (
    VARIANTS,
    Measurement,
    ScalingJob,
    run_rank,
)
from benchmarks.sweep.config_dict import config_dict

CONF = Path(__file__).resolve().parents[2] / "conf" / "problem"
GGN_COLUMNS = {"mc1": 1, "exact": None}  # exact: the number of classes


def load_job(
    problem: str,
    world_size: int,
    global_batch: int,
    warmup_steps: int,
    timed_steps: int,
    variants: Sequence[str],
) -> ScalingJob:
    """The scaling run of a problem config (``conf/problem/<problem>.yaml``).

    Args:
        problem: The problem's name.
        world_size: Number of ranks.
        global_batch: Samples per step over all ranks.
        warmup_steps: Untimed steps.
        timed_steps: Timed steps.
        variants: Optimizers to measure.

    Returns:
        The job (training data loaded once, in float32).
    """
    cfg = OmegaConf.load(CONF / f"{problem}.yaml")
    data = instantiate(cfg.data).to(torch.device("cpu"), torch.float32)
    return ScalingJob(
        model=config_dict(cfg.model),
        x_train=data.x_train,
        y_train=data.y_train,
        world_size=world_size,
        global_batch=global_batch,
        warmup_steps=warmup_steps,
        timed_steps=timed_steps,
        variants=tuple(variants),
    )


def measure(job: ScalingJob) -> dict[str, Measurement]:
    """Spawn the job's ranks; rank 0's measurements by variant.

    Args:
        job: The run.

    Returns:
        The measurements.
    """
    with tempfile.TemporaryDirectory() as folder:
        output = Path(folder) / "measurements.json"
        mp.spawn(
            run_rank,
            args=(job, f"file://{folder}/rendezvous", str(output)),
            nprocs=job.world_size,
        )
        rows = json.loads(output.read_text())
    return {row["variant"]: Measurement(**row) for row in rows}


def predicted_bytes(job: ScalingJob, variant: str) -> float:
    """The cost model's bytes per (refresh) step of DampedNewton for the job.

    Args:
        job: The run.
        variant: ``"mc1"``, ``"exact"`` (Gram basis) or ``"kronecker"``.

    Returns:
        Bytes one rank receives per step.
    """
    model = instantiate(job.model, generator=torch.Generator().manual_seed(0))
    if variant == "kronecker":
        factors = FLOAT32_BYTES * kronecker_numbers(model)
        return kronecker_bytes(factors, job.world_size)
    local = job.global_batch // job.world_size
    columns = GGN_COLUMNS[variant] or int(job.y_train.max()) + 1
    layout = gathered_layout(model, job.x_train.shape[1:], columns, local)
    return dampednewton_bytes(
        FLOAT32_BYTES * layout.floats_per_sample, job.world_size, local
    )


def _kb(value: float | None) -> str:
    return "—" if value is None else f"{value / 1e3:.1f}"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{1e3 * value:.1f}"


def measured_table(
    problem: str,
    variant: str,
    runs: dict[int, tuple[ScalingJob, dict[str, Measurement]]],
) -> list[str]:
    """Markdown lines of one problem's and GGN's measurements, by world size.

    Args:
        problem: The problem's name.
        variant: ``"mc1"``, ``"exact"`` or ``"kronecker"``.
        runs: Job and measurements per world size.

    Returns:
        The lines.
    """
    lines = [
        f"\n{problem}, DampedNewton {variant}:",
        "| ranks | local batch | ms/step | comm ms/step | DN kB/step | model kB "
        "| DDP kB/step | DN/DDP bytes | SGD ms/step | Adam ms/step | DN/SGD time |",
        "|" + " --- |" * 11,
    ]
    for world_size, (job, found) in sorted(runs.items()):
        newton = found[variant]
        sgd, adam = found.get("sgd"), found.get("adam")
        dn_bytes = newton.communication_bytes or 0.0
        ratio = f"{dn_bytes / newton.ddp_bytes:.1f}" if newton.ddp_bytes else "—"
        slowdown = f"{newton.seconds / sgd.seconds:.1f}" if sgd else "—"
        lines.append(
            f"| {world_size} | {job.global_batch // world_size} "
            f"| {_ms(newton.seconds)} | {_ms(newton.communication_seconds)} "
            f"| {_kb(dn_bytes)} | {_kb(predicted_bytes(job, variant))} "
            f"| {_kb(newton.ddp_bytes)} | {ratio} "
            f"| {_ms(sgd.seconds if sgd else None)} "
            f"| {_ms(adam.seconds if adam else None)} "
            f"| {slowdown} |"
        )
    return lines


FASHION_MNIST_LOADER = "benchmarks.problems.data.load_fashion_mnist"


def _input_shape(data: Any) -> tuple[int, ...]:
    """One input's shape: Fashion-MNIST's without reading its files, else the data's."""
    if data._target_ == FASHION_MNIST_LOADER:
        return (28 * 28,) if data.get("flatten", True) else (1, 28, 28)
    return tuple(instantiate(data).x_test.shape[1:])


def extrapolation_table(
    problem: str, local_batch: int, columns: int, world_sizes: Sequence[int]
) -> list[str]:
    """Markdown lines of the cost model for ``problem`` at ``local_batch`` per GPU.

    Args:
        problem: The problem's name (its model, and its data for the input shape).
        local_batch: Samples per GPU.
        columns: Monte-Carlo samples (or classes for the exact GGN).
        world_sizes: GPUs.

    Returns:
        The lines.
    """
    cfg = OmegaConf.load(CONF / f"{problem}.yaml")
    model = instantiate(cfg.model, generator=torch.Generator().manual_seed(0))
    layout = gathered_layout(model, _input_shape(cfg.data), columns, local_batch)
    lines = [
        f"\n{problem} ({layout.num_parameters / 1e6:.2f} M parameters), "
        f"{local_batch} samples per GPU, C = {columns}: "
        f"{FLOAT32_BYTES * layout.floats_per_sample / 1e3:.1f} kB gathered per "
        "sample (a model, not a measurement)",
        "| GPUs | DN MB/step | DDP MB/step | DN/DDP | DN ms NVLink | DDP ms NVLink "
        "| DN ms IB | DDP ms IB | Gram m | Gram GFLOP | eigh GFLOP | fwd+bwd GFLOP |",
        "|" + " --- |" * 12,
    ]
    for world_size in world_sizes:
        newton = dampednewton_bytes(
            FLOAT32_BYTES * layout.floats_per_sample, world_size, local_batch
        )
        ddp = all_reduce_bytes(world_size, FLOAT32_BYTES * layout.num_parameters)
        times = [
            f"{1e3 * seconds:.2f}"
            for link in (NVLINK, INFINIBAND)
            for seconds in (
                all_gather_seconds(
                    newton, layout.tensors + FIXED_COLLECTIVES, world_size, link
                ),
                all_reduce_seconds(
                    ddp, ddp_buckets(layout.num_parameters), world_size, link
                ),
            )
        ]
        gram = gram_growth(layout, world_size, local_batch, columns)
        cells = [
            str(world_size),
            f"{newton / 1e6:.1f}",
            f"{ddp / 1e6:.1f}",
            f"{newton / ddp:.1f}" if ddp else "—",
            *times,
            str(gram.size),
            f"{gram.formation_flops / 1e9:.0f}",
            f"{gram.eigh_flops / 1e9:.0f}",
            f"{gram.local_backward_flops / 1e9:.1f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _arguments(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--problems",
        nargs="+",
        help="measured: mnist1d_mlp mnist1d_cnn (default); --extrapolate: fmnist_2c2d",
    )
    parser.add_argument(
        "--world-sizes",
        nargs="+",
        type=int,
        help="measured: 1 2 4 (default); --extrapolate: 1 2 4 8 16 32 64",
    )
    parser.add_argument("--batch", type=int, default=128, help="global batch")
    parser.add_argument(
        "--weak", action="store_true", help="--batch per rank (weak scaling)"
    )
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS))
    parser.add_argument(
        "--extrapolate",
        action="store_true",
        help="print the cost model for --batch samples per GPU, MC-1 (runs nothing)",
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    """Print the measured tables, or the cost model's with ``--extrapolate``."""
    args = _arguments(argv)
    if args.extrapolate:
        for problem in args.problems or ["fmnist_2c2d"]:
            sizes = args.world_sizes or [1, 2, 4, 8, 16, 32, 64]
            print("\n".join(extrapolation_table(problem, args.batch, 1, sizes)))
        return
    world_sizes = args.world_sizes or [1, 2, 4]
    cores = os.cpu_count() or 1
    print(
        f"gloo on CPU, 1 thread per rank, {cores} cores: "
        + (
            f"{max(world_sizes)} ranks oversubscribe the {cores} cores"
            if max(world_sizes) > cores
            else "one core per rank"
        )
        + (
            f"; weak scaling ({args.batch} per rank)"
            if args.weak
            else f"; strong scaling (global batch {args.batch})"
        )
    )
    for problem in args.problems or ["mnist1d_mlp", "mnist1d_cnn"]:
        runs = {}
        for world_size in world_sizes:
            batch = args.batch * world_size if args.weak else args.batch
            job = load_job(
                problem, world_size, batch, args.warmup, args.steps, args.variants
            )
            runs[world_size] = (job, measure(job))
        for variant in ("mc1", "exact", "kronecker"):
            if variant in args.variants:
                print("\n".join(measured_table(problem, variant, runs)), flush=True)


if __name__ == "__main__":
    main()
