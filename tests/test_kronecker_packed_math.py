"""Layers of all shapes zero-padded into one batch (pure math) against each layer alone.

Each layer's coefficients bit for bit inside its blocks and zeros around them, and
each layer's step its own dense float64 solve.
"""

from __future__ import annotations

import pytest
import torch

from dampednewton.math.kronecker import kronecker_direction, stacked_eigen
from dampednewton.math.kronecker_coefficients import layer_coefficients
from dampednewton.math.kronecker_packed import (
    padded_coefficients,
    padded_eigen,
    padding_masks,
)
from tests.assertions import assert_close
from tests.test_kronecker_math import DTYPE, dense_kronecker, truncated_eigen

# Layers of different shapes, each side kept whole or truncated, one of them two
# layers of one shape stacked: (d_out, d_in, kept output rank, kept input rank, count).
PACKED_LAYERS = [(5, 7, 5, 7, 1), (3, 9, 2, 4, 1), (6, 4, 3, 4, 2), (2, 2, 2, 1, 1)]


def packed_layers() -> tuple[list, list]:
    """:data:`PACKED_LAYERS`: each layer's and each batch's eigenpairs and gradient.

    Returns:
        Per layer ``(output eigenpairs, input eigenpairs, gradient)``; per batch (a
        stacked pair counts once) ``(output eigenpairs, input eigenpairs)``.
    """
    layers, batches = [], []
    generator = torch.Generator().manual_seed(50)
    for index, (rows, columns, out_rank, in_rank, count) in enumerate(PACKED_LAYERS):
        outputs = [
            truncated_eigen(rows, out_rank, seed=60 + 10 * index + k)
            for k in range(count)
        ]
        inputs = [
            truncated_eigen(columns, in_rank, seed=61 + 10 * index + k)
            for k in range(count)
        ]
        gradients = [
            torch.randn(rows, columns, generator=generator, dtype=DTYPE)
            for _ in range(count)
        ]
        layers += zip(outputs, inputs, gradients, strict=True)
        output = outputs[0] if count == 1 else stacked_eigen(outputs)
        input_side = inputs[0] if count == 1 else stacked_eigen(inputs)
        batches.append((output, input_side))
    return layers, batches


def packed_coefficients(batches: list, damping: float):
    """The padded eigenpairs of :func:`packed_layers`' batches, their coefficients."""
    output = padded_eigen([batch[0] for batch in batches])
    inputs = padded_eigen([batch[1] for batch in batches])
    shapes = [
        [
            (rows, out_rank)
            for rows, _, out_rank, _, count in PACKED_LAYERS
            for _ in range(count)
        ],
        [
            (columns, in_rank)
            for _, columns, _, in_rank, count in PACKED_LAYERS
            for _ in range(count)
        ],
    ]
    masks = padding_masks(*shapes, output.vectors)
    return output, inputs, padded_coefficients(output, inputs, damping, masks)


@pytest.mark.parametrize("damping", [0.0, 0.01])
def test_padded_coefficients_are_each_layers_zero_padded(damping):
    """Each layer's own coefficients bit for bit, zeros around (no NaN at δ = 0)."""
    layers, batches = packed_layers()
    _, _, padded = packed_coefficients(batches, damping)
    assert padded.curvatures is None
    assert padded.core.shape == (5, 5, 7)
    for k, (output, inputs, _) in enumerate(layers):
        own = layer_coefficients(output, inputs, damping, False)
        rank, in_rank = output.values.shape[-1], inputs.values.shape[-1]
        blocks = {
            "slopes": (slice(0, rank), slice(0, in_rank)),
            "core": (slice(0, rank), slice(0, in_rank)),
            "rows": (slice(0, rank),),
            "row_weights": (slice(0, rank),),
            "columns": (slice(0, in_rank),),
            "column_weights": (slice(0, in_rank),),
            "both": (),
        }
        for name, block in blocks.items():
            entries = getattr(padded, name)[k]
            expected = getattr(own, name)
            inside = entries[block] if block else entries
            if expected is None:
                assert not inside.any(), name
            else:
                assert torch.equal(inside, expected), name
            outside = entries.clone()
            if block:
                outside[block] = 0
            else:
                outside.zero_()
            assert not outside.any(), name


def test_a_padded_batch_of_layers_of_all_shapes_steps_as_each_layer_alone():
    """Zero-padded to the largest shapes, every layer's step is its own dense solve."""
    layers, batches = packed_layers()
    output, inputs, coefficients = packed_coefficients(batches, 0.01)
    rows, columns = output.vectors.shape[-2], inputs.vectors.shape[-2]
    assert (rows, columns) == (6, 9)
    assert output.vectors.shape[-1] == 5 and inputs.vectors.shape[-1] == 7
    gradient = torch.zeros(len(layers), rows, columns, dtype=DTYPE)
    for k, (_, _, layer_gradient) in enumerate(layers):
        gradient[k, : layer_gradient.shape[0], : layer_gradient.shape[1]] = (
            layer_gradient
        )
    packed = kronecker_direction(gradient, output, inputs, coefficients, False)
    for k, (layer_output, layer_input, layer_gradient) in enumerate(layers):
        block = packed.direction[k]
        size = layer_gradient.shape
        damped, _ = dense_kronecker(layer_output, layer_input, 0.01)
        expected = -torch.linalg.solve(damped, layer_gradient.flatten())
        assert_close(block[: size[0], : size[1]].flatten(), expected, rtol=1e-9)
        assert torch.count_nonzero(block) == torch.count_nonzero(
            block[: size[0], : size[1]]
        ), "the padding stays zero"
        assert_close(packed.slope[k], layer_gradient.flatten() @ expected, rtol=1e-9)
