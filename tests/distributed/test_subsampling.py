"""Sub-sampling under torch.distributed: local indices, the same on every rank."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from tests.distributed.workers import Job, assert_matches_reference, spawn

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed"),
]


BOTH = {"subsampling_ggn": [2, 1], "subsampling_grad": [0, 3], "averaging": None}


@pytest.mark.parametrize(
    ("model", "options"),
    [
        ("mlp", {"subsampling_ggn": [3, 0]}),
        ("mlp", {"subsampling_grad": [1, 2, 3], "averaging": None}),
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
    ranks = spawn(job, 2, tmp_path)
    assert_matches_reference(ranks, job, 2)
