"""Train one (problem, optimizer, hyperparameters, seed); Hydra sweeps run many.

Examples (from the repository root)::

    python benchmarks/run.py                                  # digits_mlp, SGD
    python benchmarks/run.py problem=mnist1d_mlp optimizer=adam optimizer.lr=1e-3
    python benchmarks/run.py --multirun +sweep=default         # the default comparison

Every job writes ``result.json`` into its Hydra job directory; a multirun ends with
a report (CSV, Markdown tables, plots) in ``<sweep dir>/report``.
"""

import sys
from pathlib import Path

# `python benchmarks/run.py` puts benchmarks/ (not the repository root) on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from benchmarks.job import run_job


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> dict:
    """Run the job described by ``cfg`` (see ``conf/config.yaml``).

    Args:
        cfg: The composed config.

    Returns:
        The job summary (consumed by the progress callback).
    """
    return run_job(cfg, Path(HydraConfig.get().runtime.output_dir))


if __name__ == "__main__":
    main()
