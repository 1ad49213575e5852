"""Per-layer gather route by bytes moved: cost function, equivalence, byte count."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from dampednewton.math.traffic import (
    LinearLayerShapes,
    Route,
    bytes_received,
    cheaper_route,
    gathered_numbers,
)
from tests.distributed.workers import (
    LOCAL_BATCH,
    Job,
    assert_matches_reference,
    make_model,
    spawn,
)

FLOAT32, FLOAT64 = 4, 8


def test_plain_linear_bytes_by_hand():
    # Linear(5, 6) with bias, C = 3 columns, N = N' = 4 samples: the weight and the
    # bias share the back-propagated square root and the output gradients.
    layer = LinearLayerShapes(
        num_outputs=3,
        num_samples=4,
        gradient_samples=4,
        positions=None,
        in_features=5,
        out_features=6,
        bias=True,
    )
    factors = 3 * 4 * 6 + 4 * 5 + 4 * 6  # backproped, inputs, output gradients
    sqrt_ggn = 3 * 4 * 6 * 5 + (3 * 4 * 6 + 4 * 6)  # V, then the bias's buffers
    assert gathered_numbers(layer) == {Route.FACTORS: factors, Route.SQRT_GGN: sqrt_ggn}
    assert bytes_received(layer, world_size=3, element_size=FLOAT32) == {
        Route.FACTORS: 2 * 4 * factors,
        Route.SQRT_GGN: 2 * 4 * sqrt_ggn,
    }
    assert cheaper_route(layer) is Route.FACTORS


def test_sequence_linear_bytes_by_hand():
    # Linear(5, 6) on [N, 7, 5] inputs: the bias's square root is summed over the
    # P = 7 positions, its own tensor.
    layer = LinearLayerShapes(
        num_outputs=3,
        num_samples=4,
        gradient_samples=4,
        positions=7,
        in_features=5,
        out_features=6,
        bias=True,
    )
    bias = 3 * 4 * 6 + 4 * 6
    factors = 7 * (3 * 4 * 6 + 4 * 5 + 4 * 6) + bias
    sqrt_ggn = 3 * 4 * 6 * 5 + bias
    assert bytes_received(layer, world_size=2, element_size=FLOAT64) == {
        Route.FACTORS: 8 * factors,
        Route.SQRT_GGN: 8 * sqrt_ggn,
    }
    assert cheaper_route(layer) is Route.SQRT_GGN


def test_conv2d_bytes_by_hand():
    # Conv2d(16, 32, 3, padding=1) on 14×14: P = 196 positions, d_in = 16·9 = 144;
    # C = 10, N = 8, per-sample gradients needed, 2 of the samples sub-sampled.
    layer = LinearLayerShapes(
        num_outputs=10,
        num_samples=8,
        gradient_samples=2,
        positions=196,
        in_features=144,
        out_features=32,
        bias=True,
        subsampled=True,
        per_sample_gradients=True,
    )
    bias = 10 * 8 * 32 + 2 * 32
    factors = 196 * (10 * 8 * 32 + 8 * 144 + 2 * 32) + 2 * 196 * 144 + bias
    sqrt_ggn = 10 * 8 * 32 * 144 + 2 * 32 * 144 + bias
    assert bytes_received(layer, world_size=2, element_size=FLOAT32) == {
        Route.FACTORS: 4 * factors,
        Route.SQRT_GGN: 4 * sqrt_ggn,
    }
    assert cheaper_route(layer) is Route.SQRT_GGN


def test_shapes_refuse_empty_sizes():
    with pytest.raises(ValueError, match="positions must be at least 1"):
        LinearLayerShapes(3, 4, 4, 0, 5, 6, bias=False)


PER_SAMPLE = {"damping": "noise", "averaging": None}  # per-sample gradients
needs_distributed = pytest.mark.skipif(
    not dist.is_available(), reason="needs torch.distributed"
)


@pytest.mark.slow
@needs_distributed
@pytest.mark.parametrize(
    ("route", "options"),
    [
        ("factors", {}),
        ("factors", PER_SAMPLE),
        ("sqrt_ggn", PER_SAMPLE),
        ("sqrt_ggn", {"mc_samples": 1}),
    ],
    ids=["factors", "factors-per-sample", "sqrt_ggn-per-sample", "sqrt_ggn-mc"],
)
def test_each_route_equals_single_process(route, options, tmp_path):
    # The CNN's convolution (P = 16, d_in = 9, d_out = 2) prefers V, its linear
    # layer the factors; each route is forced on both.
    job = Job(model="cnn", steps=2, options=options, route=route)
    ranks = spawn(job, 2, tmp_path)
    assert_matches_reference(ranks, job, 2)


def _cnn_layers(num_outputs: int) -> list[LinearLayerShapes]:
    """The shapes of the workers' CNN on one rank (4 samples)."""
    conv = LinearLayerShapes(
        num_outputs, LOCAL_BATCH, LOCAL_BATCH, 16, 9, 2, bias=True
    )  # Conv2d(1, 2, 3) on 6×6
    linear = LinearLayerShapes(num_outputs, LOCAL_BATCH, LOCAL_BATCH, None, 32, 3, True)
    return [conv, linear]


@pytest.mark.slow
@needs_distributed
@pytest.mark.parametrize("mc_samples", [0, 1])
def test_communication_bytes_equal_cost_model(mc_samples, tmp_path):
    world_size = 2
    job = Job(model="cnn", steps=1, options={"mc_samples": mc_samples})
    layers = _cnn_layers(num_outputs=mc_samples or 3)
    assert [cheaper_route(layer) for layer in layers] == [
        Route.SQRT_GGN,
        Route.FACTORS,
    ]
    gathers = sum(
        bytes_received(layer, world_size, FLOAT64)[cheaper_route(layer)]
        for layer in layers
    )
    agreement = (world_size - 1) * 3 * FLOAT64  # loss, batch size, failure flag
    refusal = 2 * (world_size - 1) * FLOAT64  # all-reduced flags, one per rank
    # The first step's check that the replicas agree: the highest and the lowest of
    # up to four entries per parameter, all-reduced.
    entries = sum(min(4, p.numel()) for p in make_model("cnn").parameters())
    replicas = 2 * 2 * (world_size - 1) / world_size * entries * FLOAT64
    for rank in spawn(job, world_size, tmp_path):
        assert rank["communication_bytes"] == [gathers + agreement + refusal + replicas]
