"""Train one (problem, optimizer, hyperparameters, seed); Hydra sweeps run many.

Examples (from the repository root)::

    python -m benchmarks.run                                  # digits_mlp, SGD
    python -m benchmarks.run problem=mnist1d_mlp optimizer=adam optimizer.lr=1e-3
    python -m benchmarks.run --multirun +sweep=default         # the default comparison
    torchrun --nproc-per-node 2 -m benchmarks.run problem=digits_mlp  # data-parallel

Every job writes ``result.json`` into its Hydra job directory; a multirun ends with
a report (CSV, Markdown tables, plots) in ``<sweep dir>/report``. Rerunning a
multirun into the same ``hydra.sweep.dir`` keeps the jobs that completed and reruns
the others (:mod:`benchmarks.sweep.resume`). Under ``torchrun``
(:mod:`benchmarks.sweep.data_parallel`) the ranks other than 0 neither log nor write.
"""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from benchmarks.sweep.data_parallel import launched_rank, leave_process_group
from benchmarks.sweep.job import run_job
from benchmarks.sweep.result import RunResult


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> RunResult:
    """Run the job described by ``cfg`` (see ``conf/config.yaml``).

    Args:
        cfg: The composed config.

    Returns:
        The job's record (consumed by the progress callback).
    """
    hydra_config = HydraConfig.get()
    return run_job(
        cfg, Path(hydra_config.runtime.output_dir), list(hydra_config.overrides.task)
    )


# Ranks other than 0 under torchrun: no .hydra/ copy of the config, no job log.
FOLLOWER_OVERRIDES = ("hydra.output_subdir=null", "hydra/job_logging=disabled")


if __name__ == "__main__":
    if launched_rank() != 0:
        sys.argv += FOLLOWER_OVERRIDES
    completed = False
    try:
        main()
        completed = True
    finally:
        leave_process_group(completed=completed)
