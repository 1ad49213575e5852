"""The diagnostics monitor under torch.distributed (gloo, CPU): the global batch's."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch.distributed as dist

from dampednewton import KroneckerBasis, NoiseAwareDamping
from tests.distributed.monitor_workers import MonitorJob, monitored, run_rank
from tests.distributed.spawning import spawn_ranks

# Each test spawns processes that import torch and BackPACK: 5-15 s.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed"),
]


def _assert_records_match(records, expected, *, exact: bool) -> None:
    assert len(records) == len(expected)
    for record, reference in zip(records, expected, strict=True):
        assert record.keys() == reference.keys()
        for key, value in record.items():
            wanted = reference[key]
            integral = np.issubdtype(np.asarray(wanted).dtype, np.integer)
            if exact or integral:
                np.testing.assert_array_equal(value, wanted, err_msg=key)
            else:
                np.testing.assert_allclose(
                    value, wanted, rtol=1e-10, atol=1e-12, err_msg=key
                )


def test_monte_carlo_trace_draws_per_rank_from_the_monitors_seed(tmp_path):
    job = MonitorJob(monte_carlo=True)
    ranks = spawn_ranks(run_rank, job, 2, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = monitored(job, 2, rank=None)
    for rank in ranks:
        _assert_records_match(rank["records"], ranks[0]["records"], exact=True)
        for record, single, traces in zip(
            rank["records"],
            reference["records"],
            reference["sharded_traces"],
            strict=True,
        ):
            sampled = {key for key in record if key.startswith("diag_ggn_mc")}
            assert sampled == traces.keys()
            _assert_records_match(
                [{k: v for k, v in record.items() if k not in sampled}],
                [{k: v for k, v in single.items() if k not in sampled}],
                exact=False,
            )
            _assert_records_match(
                [{key: record[key] for key in sampled}], [traces], exact=False
            )
    # Each rank draws its own samples: the two steps' traces differ from a draw
    # shared by both ranks (the single process's from the seed).
    assert (
        ranks[0]["records"][0]["diag_ggn_mc/trace"]
        != (reference["records"][0]["diag_ggn_mc/trace"])
    )


@pytest.mark.parametrize(
    ("world_size", "job"),
    [
        (2, MonitorJob(ddp=True)),
        (2, MonitorJob(ddp=False)),
        (2, MonitorJob(ddp=True, in_optimizer=True)),
        (
            3,
            MonitorJob(
                model="cnn",
                ddp=False,
                in_optimizer=True,
                options={"damping": NoiseAwareDamping(), "averaging": None},
            ),
        ),
        (
            2,
            MonitorJob(
                model="cnn",
                ddp=True,
                in_optimizer=True,
                options={"basis": KroneckerBasis(), "averaging": None},
            ),
        ),
    ],
    ids=[
        "standalone-ddp-2",
        "standalone-by-hand-2",
        "optimizer-ddp-2",
        "cnn-by-hand-noise-aware-3",
        "cnn-kronecker-ddp-2",
    ],
)
def test_records_equal_single_process_on_concatenated_batch(world_size, job, tmp_path):
    ranks = spawn_ranks(run_rank, job, world_size, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        expected = monitored(job, world_size, rank=None)["records"]
    assert expected[0]["batch_size"] == world_size * 4
    for rank in ranks:
        _assert_records_match(rank["records"], expected, exact=False)
        _assert_records_match(rank["records"], ranks[0]["records"], exact=True)
        assert rank["bytes"] > 0
        assert rank["refuses_other_group"] == job.in_optimizer
