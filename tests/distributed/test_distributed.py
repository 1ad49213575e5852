"""DampedNewton under torch.distributed (gloo, CPU): spawned 2- and 3-rank groups."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from dampednewton import CurvatureAveraging, KroneckerBasis, NoiseFilter, ScheduleFree
from tests.distributed.spawning import spawn_ranks
from tests.distributed.workers import (
    EVERY_RANK,
    Job,
    assert_matches_reference,
    run_created_before_init,
    spawn,
)

KRONECKER = {
    "basis": KroneckerBasis(),
    "averaging": CurvatureAveraging(decay=0.9, interval=2, ramp=False),
}
"""The Kronecker basis, refreshed every other step (the steps between included)."""
NOISE_FILTER = {
    **KRONECKER,
    "basis": KroneckerBasis(rotation_interval=1, noise_filter=NoiseFilter(0.9, 0.8)),
}
"""With the noise filter, its moments rotated on every refresh."""
PACKED = {**KRONECKER, "basis": KroneckerBasis(packed=True)}
"""Every layer in one padded batch."""
SCHEDULE_FREE = {**KRONECKER, "momentum": ScheduleFree(0.8, 2.0), "kl_clip": 1e-2}
"""Schedule-Free averaging of the steps instead of the heavy ball."""

# Each test spawns processes that import torch and BackPACK: 5-25 s.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not dist.is_available(), reason="needs torch.distributed"),
]


@pytest.mark.parametrize(
    ("world_size", "job"),
    [
        (2, Job(model="mlp", steps=3)),
        (3, Job(model="cnn", steps=3)),
        (2, Job(model="mlp", steps=3, options={"damping": "lm"}, ddp=True)),
        (
            2,
            Job(
                model="cnn",
                steps=3,
                options={"averaging": None, "complement": None, "momentum": 0.0},
            ),
        ),
        (2, Job(model="mlp", steps=4, options=KRONECKER)),
        (
            3,
            Job(model="cnn", steps=3, options={**KRONECKER, "damping": "lm"}, ddp=True),
        ),
        (2, Job(model="cnn", steps=3, options={**KRONECKER, "mc_samples": 1})),
        (2, Job(model="mlp", steps=5, options=NOISE_FILTER, ddp=True)),
        (2, Job(model="mlp", steps=5, options=SCHEDULE_FREE, ddp=True)),
        (2, Job(model="cnn", steps=4, options=PACKED, ddp=True)),
        (2, Job(model="mlp", steps=8, options={"damping": "lm"}, ddp=True)),
        (2, Job(model="mlp-bce", steps=3, ddp=True)),
        (2, Job(model="mlp-bce", steps=4, options=KRONECKER)),
    ],
    ids=[
        "mlp-2",
        "cnn-3",
        "mlp-lm-ddp-2",
        "cnn-vivit-2",
        "mlp-kronecker-2",
        "cnn-kronecker-lm-ddp-3",
        "cnn-kronecker-mc-2",
        "mlp-kronecker-noise-filter-ddp-2",
        "mlp-kronecker-schedule-free-ddp-2",
        "cnn-kronecker-packed-ddp-2",
        "mlp-lm-between-refreshes-ddp-2",  # the damping adapts on refreshes only
        "mlp-bce-multilabel-ddp-2",
        "mlp-bce-multilabel-kronecker-2",
    ],
)
def test_step_equals_single_process_on_concatenated_batch(world_size, job, tmp_path):
    assert_matches_reference(spawn(job, world_size, tmp_path), job, world_size)


@pytest.mark.parametrize("basis", ["gram", "kronecker"])
@pytest.mark.parametrize("mc_samples", [0, 1])
def test_replicas_bit_identical_over_20_steps(mc_samples, basis, tmp_path):
    options = {"mc_samples": mc_samples, **(KRONECKER if basis == "kronecker" else {})}
    job = Job(model="mlp", steps=20, options=options)
    first, second = spawn(job, 2, tmp_path)
    for mine, other in zip(first["history"], second["history"], strict=True):
        assert torch.equal(mine, other)
    assert not torch.equal(first["history"][0], first["history"][-1])


@pytest.mark.parametrize("options", [{}, KRONECKER], ids=["gram", "kronecker"])
def test_nan_loss_on_one_rank_every_rank_refuses(options, tmp_path):
    job = Job(steps=3, nan_rank=1, nan_step=1, options={"nonfinite": "skip", **options})
    ranks = spawn(job, 2, tmp_path)
    for rank in ranks:
        assert rank["skipped"] == [0, 1, 1]
        assert torch.equal(rank["history"][1], rank["history"][0])
        assert not torch.equal(rank["history"][2], rank["history"][1])
        assert torch.isnan(rank["losses"][1])
    assert torch.equal(ranks[0]["history"][2], ranks[1]["history"][2])


@pytest.mark.parametrize("options", [{}, KRONECKER], ids=["gram", "kronecker"])
def test_a_refusal_names_the_rank_whose_loss_is_not_finite(options, tmp_path):
    job = Job(steps=2, nan_rank=1, nan_step=1, options=options)
    for rank in spawn(job, 2, tmp_path):
        assert rank["errors"][0] is None
        assert "local loss is not finite on rank(s) [1]" in rank["errors"][1]
        assert torch.equal(rank["history"][1], rank["history"][0])


def test_monte_carlo_nan_output_on_one_rank_every_rank_refuses(tmp_path):
    job = Job(
        steps=2, nan_rank=0, nan_step=0, options={"nonfinite": "skip", "mc_samples": 1}
    )
    ranks = spawn(job, 2, tmp_path)
    for rank in ranks:
        assert rank["skipped"] == [1, 1]
        assert not torch.equal(rank["history"][1], rank["history"][0])
    assert torch.equal(ranks[0]["history"][0], ranks[1]["history"][0])
    assert torch.equal(ranks[0]["history"][1], ranks[1]["history"][1])


@pytest.mark.parametrize("options", [{}, KRONECKER], ids=["gram", "kronecker"])
@pytest.mark.parametrize("mc_samples", [0, 1])
def test_state_dict_saved_on_rank_0_resumes_identically(mc_samples, options, tmp_path):
    job = Job(
        steps=5,
        resume_at=2,
        options={"mc_samples": mc_samples, "damping": "lm", **options},
    )
    for rank in spawn(job, 2, tmp_path):
        for continued, resumed in zip(
            rank["history"][2:], rank["resumed"], strict=True
        ):
            assert torch.equal(continued, resumed)


@pytest.mark.parametrize("step", [1, 2], ids=["refresh", "between"])
@pytest.mark.parametrize("options", [{}, KRONECKER], ids=["gram", "kronecker"])
def test_a_closure_that_raises_on_one_rank_raises_on_every_rank(
    options, step, tmp_path
):
    """No rank waits for the failed one, and no rank's step is taken."""
    job = Job(steps=4, fault_rank=1, fault_step=step, options=options)
    ranks = spawn(job, 2, tmp_path)
    assert "the closure failed after backward" in ranks[1]["errors"][step]
    assert "raised on rank(s) [1]" in ranks[0]["errors"][step]
    for rank in ranks:
        assert [e is None for e in rank["errors"]] == [s != step for s in range(4)]
        assert torch.equal(rank["history"][step], rank["history"][step - 1])
    assert torch.equal(ranks[0]["history"][-1], ranks[1]["history"][-1])


@pytest.mark.parametrize("step", [1, 2], ids=["refresh", "between"])
@pytest.mark.parametrize("options", [{}, KRONECKER], ids=["gram", "kronecker"])
def test_unequal_local_batches_are_refused_on_every_rank(options, step, tmp_path):
    """The global batch's mean gradient needs equal shares, between refreshes too."""
    job = Job(steps=3, fault_rank=1, fault_step=step, fault="short", options=options)
    for rank in spawn(job, 2, tmp_path):
        assert "same local batch size" in rank["errors"][step]
        assert torch.equal(rank["history"][step], rank["history"][step - 1])


@pytest.mark.parametrize("step", [1, 2], ids=["refresh", "between"])
@pytest.mark.parametrize("options", [{}, KRONECKER], ids=["gram", "kronecker"])
def test_a_batch_every_rank_skips_is_skipped_on_every_rank(options, step, tmp_path):
    """Every closure returns None without a backward pass (Lightning's skip).

    No rank steps, none raises, and training goes on in lock step.
    """
    job = Job(steps=4, options=options, fault_rank=EVERY_RANK, fault="skip")
    job = dataclasses.replace(job, fault_step=step)
    ranks = spawn(job, 2, tmp_path)
    for rank in ranks:
        assert rank["errors"] == [None] * 4
        assert rank["losses"][step] is None
        assert torch.equal(rank["history"][step], rank["history"][step - 1])
        assert not torch.equal(rank["history"][-1], rank["history"][step])
    assert torch.equal(ranks[0]["history"][-1], ranks[1]["history"][-1])


@pytest.mark.parametrize("fault", [None, "twice"], ids=["every-rank", "one-rank-not"])
def test_the_ranks_agree_on_the_autograd_refresh(fault, tmp_path):
    """Where one rank's autograd pass falls short, no rank refreshes on it.

    Rank 1 runs an extra forward pass at the refresh of step 2 (the Kronecker
    refreshes after the first take the autograd pass): every rank keeps its bases
    there and refreshes through BackPACK's pass from then on, in lock step.
    """
    options = {**KRONECKER, "mc_samples": 1}
    job = Job(steps=4, options=options, fault_rank=1, fault_step=2)
    job = dataclasses.replace(job, fault=fault or "raise", fault_rank=fault and 1)
    ranks = spawn(job, 2, tmp_path)
    for rank in ranks:
        assert rank["errors"] == [None] * 4
        assert rank["autograd_refreshes"] == (fault is None)
    for step in range(4):
        assert torch.equal(ranks[0]["history"][step], ranks[1]["history"][step])


@pytest.mark.parametrize("options", [{}, KRONECKER], ids=["gram", "kronecker"])
def test_an_optimizer_created_before_init_process_group_refuses_to_step(
    options, tmp_path
):
    """It resolved its default group to one process: each rank would step alone."""
    job = Job(options=options)
    for rank in spawn_ranks(run_created_before_init, job, 2, tmp_path):
        assert "created before torch.distributed.init_process_group" in rank["error"]
        assert rank["unchanged"]


@pytest.mark.parametrize("ddp", [False, True], ids=["by-hand", "ddp"])
def test_replicas_that_start_apart_are_refused_unless_ddp_aligns_them(ddp, tmp_path):
    """Averaging by hand, each rank would move its own replica by the global step."""
    ranks = spawn(Job(steps=2, apart=True, ddp=ddp), 2, tmp_path)
    for rank in ranks:
        if ddp:  # DistributedDataParallel copied rank 0's parameters to every rank
            assert rank["errors"] == [None, None]
        else:
            assert "the ranks' parameters differ" in rank["errors"][0]
    assert ddp == torch.equal(ranks[0]["history"][-1], ranks[1]["history"][-1])


@pytest.mark.parametrize("ddp_option", ["find_unused_parameters", "static_graph"])
def test_ddp_options_that_wrap_the_output_are_refused_with_the_fix(
    ddp_option, tmp_path
):
    """DDP's own autograd function between model and loss hides the output.

    Refused at the loss's forward pass on every rank, naming the option; no step.
    """
    job = Job(steps=1, ddp=True, ddp_options={ddp_option: True}, options=KRONECKER)
    for rank in spawn(job, 2, tmp_path):
        assert "took the model's output through an operation" in rank["errors"][0]
        assert f"{ddp_option}=True" in rank["errors"][0]
        assert torch.equal(rank["history"][0], rank["initial"])
