"""The communication cost model: formulas by hand; its bytes against 2 ranks' own."""

from __future__ import annotations

import pytest
import torch
from hydra.utils import instantiate
from torch import nn

from benchmarks.problems.models import mlp
from benchmarks.scaling.communication_model import (
    AGREEMENT_BYTES,
    DDP_BUCKET_BYTES,
    INFINIBAND,
    LOSS_AFTER_STEP_BYTES,
    REFUSAL_BYTES,
    Link,
    all_gather_seconds,
    all_reduce_bytes,
    all_reduce_seconds,
    dampednewton_bytes,
    ddp_buckets,
    gathered_layout,
    gram_growth,
    kronecker_bytes,
    kronecker_numbers,
)
from benchmarks.scaling.scaling import extrapolation_table, measure, predicted_bytes
from benchmarks.scaling.scaling_worker import ScalingJob


def test_linear_layers_gather_backproped_output_gradients_and_inputs():
    model = mlp(5, [7], 3, generator=torch.Generator().manual_seed(0))
    layout = gathered_layout(model, (5,), columns=2, local_batch=4)
    # Per Linear: C·d_out + d_out + d_in, shared by weight and bias.
    assert layout.floats_per_sample == (2 * 7 + 7 + 5) + (2 * 3 + 3 + 7)
    assert layout.tensors == 6
    assert layout.gram_macs_per_entry == (7 + 5) + (3 + 7)
    assert layout.forward_macs_per_sample == 5 * 7 + 7 * 3
    assert layout.num_parameters == 5 * 7 + 7 + 7 * 3 + 3


def test_convolutions_gather_structured_buffers_or_the_dense_square_root():
    conv = nn.Sequential(nn.Conv1d(25, 25, 3, stride=2, padding=1, bias=False))
    structured = gathered_layout(conv, (25, 10), columns=1, local_batch=4)
    # 5 positions: P·(C·d_out + d_out + d_in) with d_in = channels × kernel size.
    assert structured.floats_per_sample == 5 * (25 + 25 + 25 * 3)
    assert structured.tensors == 3
    # The cheaper route by bytes (the engine's rule), whatever the compute route:
    wide = nn.Sequential(nn.Conv1d(8, 64, 3), nn.Flatten())  # 4 positions
    factors = gathered_layout(wide, (8, 6), columns=1, local_batch=64)
    # P·(C·d_out + d_out + d_in) = 608 < C·|W| = 1536; the bias's own C·d_out + d_out.
    assert factors.floats_per_sample == 4 * (64 + 64 + 8 * 3) + 64 + 64
    assert factors.tensors == 3 + 2
    long = nn.Sequential(nn.Conv1d(2, 4, 3), nn.Flatten())  # 98 positions
    dense = gathered_layout(long, (2, 100), columns=1, local_batch=8)
    # C·|W| = 24 < P·(C·d_out + d_out + d_in) = 1372: the square root V, and the bias.
    assert dense.floats_per_sample == 4 * 2 * 3 + 4 + 4
    assert dense.tensors == 1 + 2


def test_bytes_per_step_follow_the_ring_formulas():
    assert dampednewton_bytes(100.0, 1, 8) == 0
    assert dampednewton_bytes(100.0, 4, 8) == pytest.approx(
        3 * (8 * 100 + AGREEMENT_BYTES) + 1.5 * 4 * REFUSAL_BYTES
    )
    assert dampednewton_bytes(100.0, 4, 8, reduction_ratio=True) == pytest.approx(
        3 * (8 * 100 + AGREEMENT_BYTES)
        + 1.5 * (4 * REFUSAL_BYTES + LOSS_AFTER_STEP_BYTES)
    )
    assert all_reduce_bytes(4, 1000) == 1500
    assert all_reduce_bytes(1, 1000) == 0
    assert ddp_buckets(1) == 1
    assert ddp_buckets(DDP_BUCKET_BYTES // 4 + 1) == 2


def test_kronecker_factors_by_hand():
    model = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Conv1d(1, 3, 2, bias=False))
    # Linear: (5 + 1)² + 7², Conv1d: (1·2)² + 3², one total each.
    assert kronecker_numbers(model) == 36 + 49 + 1 + 4 + 9 + 1
    assert kronecker_bytes(400.0, 1) == 0
    assert kronecker_bytes(400.0, 4) == pytest.approx(
        3 * AGREEMENT_BYTES + 1.5 * (4 * REFUSAL_BYTES + 400)
    )
    assert kronecker_bytes(400.0, 4, refresh=False) == pytest.approx(
        3 * AGREEMENT_BYTES + 1.5 * 4 * REFUSAL_BYTES
    )


def test_alpha_beta_times():
    link = Link("test", bandwidth=1e9, latency=1e-5)
    assert all_gather_seconds(1e6, 3, 4, link) == pytest.approx(9e-5 + 1e-3)
    assert all_reduce_seconds(1e6, 1, 4, link) == pytest.approx(6e-5 + 1e-3)
    assert INFINIBAND.bandwidth < 1e11
    with pytest.raises(ValueError, match="positive bandwidth"):
        Link("broken", bandwidth=0.0, latency=1e-6)


def test_gram_matrix_grows_with_the_global_batch():
    model = mlp(5, [7], 3, generator=torch.Generator().manual_seed(0))
    layout = gathered_layout(model, (5,), columns=1, local_batch=4)
    one, eight = (gram_growth(layout, r, 4, 1) for r in (1, 8))
    assert (one.size, eight.size) == (4, 32)
    assert eight.entries == 64 * one.entries
    assert eight.eigh_flops == 512 * one.eigh_flops
    assert eight.formation_flops == 64 * one.formation_flops
    assert eight.local_backward_flops == one.local_backward_flops


def test_extrapolation_table_has_one_row_per_world_size():
    lines = extrapolation_table("digits_mlp", 16, 1, [1, 2, 8])
    rows = [
        line.split("|")[1:-1] for line in lines if line[:3] in ("| 1", "| 2", "| 8")
    ]
    assert [row[0].strip() for row in rows] == ["1", "2", "8"]
    assert [int(row[8]) for row in rows] == [16, 32, 128]  # Gram size R·n·C
    assert "a model, not a measurement" in lines[0]


def _job(model: dict, input_shape: tuple[int, ...]) -> ScalingJob:
    generator = torch.Generator().manual_seed(0)
    return ScalingJob(
        model=model,
        x_train=torch.randn(32, *input_shape, generator=generator),
        y_train=torch.randint(10, (32,), generator=generator),
        world_size=2,
        global_batch=8,
        warmup_steps=1,
        timed_steps=2,
        variants=("mc1", "exact", "kronecker", "sgd"),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("model", "input_shape"),
    [
        (
            {
                "_target_": "benchmarks.problems.models.mlp",
                "in_features": 6,
                "hidden": [5],
                "out_features": 10,
            },
            (6,),
        ),
        (
            {"_target_": "benchmarks.problems.models.mnist1d_cnn", "channels": 3},
            (1, 40),
        ),
    ],
    ids=["mlp", "cnn"],
)
def test_model_bytes_equal_the_measured_bytes_of_two_ranks(model, input_shape):
    """Spawns 2 gloo ranks (a few seconds): measured bytes per step = the model's."""
    job = _job(model, input_shape)
    found = measure(job)
    built = instantiate(model, generator=torch.Generator())
    parameters = sum(p.numel() for p in built.parameters())
    for variant in ("mc1", "exact", "kronecker"):
        assert found[variant].communication_bytes == predicted_bytes(job, variant)
        assert found[variant].communication_seconds > 0
    for variant in ("mc1", "exact", "kronecker", "sgd"):
        assert found[variant].ddp_bytes == all_reduce_bytes(2, 4 * parameters)
        assert found[variant].ddp_buckets == 1
        assert found[variant].seconds > 0
    assert found["sgd"].communication_bytes is None


def test_extrapolation_needs_no_fashion_mnist_files():
    """The cost model takes Fashion-MNIST's input shape without reading the data."""
    lines = extrapolation_table("fmnist_2c2d", 128, 1, [2])
    assert "fmnist_2c2d (3.27 M parameters)" in lines[0]
    assert len(lines) == 4
