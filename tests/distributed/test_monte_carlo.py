"""Monte-Carlo GGN under torch.distributed: the step of the ranks' own draws."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed.workers import Job, reference, run_rank

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed"),
]


def _spawn(job: Job, world_size: int, tmp_path: Path) -> list[dict[str, Any]]:
    out = tmp_path / "out"
    out.mkdir()
    mp.spawn(
        run_rank,
        args=(world_size, str(tmp_path / "rendezvous"), str(out), job),
        nprocs=world_size,
    )
    return [torch.load(out / f"{rank}.pt") for rank in range(world_size)]


@pytest.mark.parametrize(("world_size", "model"), [(2, "mlp"), (2, "cnn"), (3, "mlp")])
def test_monte_carlo_step_equals_single_process_with_the_ranks_draws(
    world_size, model, tmp_path
):
    # The reference draws each rank's slice of the labels from that rank's
    # generator of the step, seeded from (seed, rank, step).
    job = Job(model=model, steps=3, options={"mc_samples": 1})
    ranks = _spawn(job, world_size, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = reference(job, world_size)
    for rank in ranks:
        for step, params in enumerate(rank["history"]):
            torch.testing.assert_close(
                params, expected[step], rtol=1e-10, atol=1e-12, msg=f"step {step}"
            )
