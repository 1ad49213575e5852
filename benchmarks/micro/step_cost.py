"""Cost of one damped Newton step relative to one SGD step (not a test).

For each model, GGN variant (exact, MC-1) and batch size, prints in one process the
median wall time of an SGD step (forward, backward, update), of ``DampedNewton.step``
with ViViT's step (the fast, structured path; top-10, constant damping), of the
materialized path (BackPACK's dense square roots and individual gradients, as in
ViViT), and of ``DampedNewton`` with the package's defaults (the Kronecker basis:
factors refreshed on its schedule, every 15 steps after the ramp, constant damping,
trust region, momentum), and their ratios to SGD. With
``--memory``, each variant but the defaults also runs in a fresh process that reports
its peak memory
(growth of the resident-set peak during the steps on CPU,
``torch.cuda.max_memory_allocated`` on GPU).

    python -m benchmarks.micro.step_cost             # MLP and CNN, N=128
    python -m benchmarks.micro.step_cost --models mlp-large --batch-sizes 32 128 512
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

from benchmarks.micro.harness import DIRECTIONS, MODELS, make_step, round_robin_medians

NOT_RUN = "—"  # the cells of the materialized path under --skip-materialized


def peak_memory_mib(variant, model_name, batch_size, device_name) -> float:
    """Peak memory of one variant, measured in a fresh process."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.micro.step_cost",
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
    parser.add_argument(
        "--ggn", nargs="+", default=["mc1", "exact"], choices=["mc1", "exact"]
    )
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
