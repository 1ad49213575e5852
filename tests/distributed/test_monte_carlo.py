"""Monte-Carlo GGN under torch.distributed: the step of the ranks' own draws."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed.workers import Job, assert_matches_reference, spawn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed"),
]


@pytest.mark.parametrize(
    ("world_size", "model"), [(2, "mlp"), (3, "mlp"), (2, "mlp-bce")]
)
def test_monte_carlo_step_equals_single_process_with_the_ranks_draws(
    world_size, model, tmp_path
):
    # The reference draws each rank's slice of the labels from that rank's
    # generator of the step, seeded from (seed, rank, step). (The CNN's: with each
    # gather route in test_routes.) The multi-label binary cross-entropy draws its
    # Bernoulli labels the same way.
    job = Job(model=model, steps=3, options={"mc_samples": 1})
    ranks = spawn(job, world_size, tmp_path)
    assert_matches_reference(ranks, job, world_size)
