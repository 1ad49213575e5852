"""Sub-sampling under torch.distributed: local indices, the same on every rank."""

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


BOTH = {"subsampling_ggn": [2, 1], "subsampling_grad": [0, 3], "averaging": None}


@pytest.mark.parametrize(
    ("model", "options"),
    [
        ("mlp", {"subsampling_ggn": [3, 0]}),
        ("mlp", {"subsampling_grad": [1, 2, 3]}),
        ("mlp", BOTH),
        ("cnn", {**BOTH, "damping": "noise"}),
    ],
    ids=["mlp-ggn", "mlp-grad", "mlp-both", "cnn-both-per-sample"],
)
def test_subsampled_step_equals_single_process_with_shifted_indices(
    model, options, tmp_path
):
    # The reference sub-samples index i of rank r as i + r·N of the concatenated batch.
    job = Job(model=model, steps=2, options=options)
    ranks = _spawn(job, 2, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = reference(job, 2)
    for rank in ranks:
        for step, params in enumerate(rank["history"]):
            torch.testing.assert_close(
                params, expected[step], rtol=1e-10, atol=1e-12, msg=f"step {step}"
            )
