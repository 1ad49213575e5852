"""Gradient accumulation under torch.distributed: micro-batches within the ranks.

Each rank splits its batch into micro-batches (losses weighted by their shares);
the steps are those of one process on the ranks' batches concatenated, with the
Monte-Carlo labels each rank draws for its micro-batches in turn.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed.workers import Job, assert_matches_reference, spawn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed"),
]


@pytest.mark.parametrize(
    ("model", "mc_samples", "micro_batches", "ddp"),
    [
        ("mlp", 0, (1, 3), True),
        ("mlp", 1, (2, 2), False),
        ("cnn", 0, (2, 2), False),
        ("cnn", 1, (1, 1, 2), True),
    ],
)
def test_micro_batches_on_two_ranks_give_the_step_of_the_global_batch(
    model, mc_samples, micro_batches, ddp, tmp_path
):
    job = Job(
        model=model,
        steps=3,
        options={"mc_samples": mc_samples},
        ddp=ddp,
        micro_batches=micro_batches,
    )
    ranks = spawn(job, 2, tmp_path)
    assert_matches_reference(ranks, job, 2)
