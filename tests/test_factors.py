"""The structured linear factor against its explicit columns, in float64.

A linear layer's square-root column ``(c, m)`` is ``b_cm x_mᵀ`` and a per-sample
gradient is ``δ_n x'_nᵀ``; the reference builds both explicitly (``[C·N, D]`` and
``[N', D]``) and forms every product densely.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from dampednewton.math.cost import mean_products_via_kernel, prefers_structured
from dampednewton.math.factors import DenseFactor, LayerCache
from dampednewton.math.linear_factors import (
    LinearFactor,
    SharedLinearFactor,
    shared_weight_sqrt_ggn,
)
from tests.assertions import assert_close


@dataclass(frozen=True)
class Shapes:
    id: str
    num_outputs: int  # C
    num_samples: int  # N (GGN samples)
    num_gradient_samples: int  # N'
    in_features: int
    out_features: int


SHAPES = [
    Shapes("mc1-wide-input", 1, 6, 6, 9, 4),
    Shapes("exact-narrow-input", 3, 5, 5, 2, 3),
    Shapes("subsampled-ggn", 2, 3, 7, 5, 4),
]


def _draw(shapes: Shapes, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)

    def normal(*size):
        return torch.randn(*size, generator=generator, dtype=torch.float64)

    backproped = normal(shapes.num_outputs, shapes.num_samples, shapes.out_features)
    inputs = normal(shapes.num_samples, shapes.in_features)
    output_gradients = normal(shapes.num_gradient_samples, shapes.out_features)
    gradient_inputs = normal(shapes.num_gradient_samples, shapes.in_features)
    return backproped, inputs, output_gradients, gradient_inputs


def _explicit(backproped, inputs, output_gradients, gradient_inputs):
    """Dense factors of weight and bias: ``V`` rows and per-sample gradients."""
    weight_rows = torch.einsum("cmo,mi->cmoi", backproped, inputs).flatten(2)
    weight = DenseFactor(
        weight_rows.flatten(end_dim=1),
        torch.Size([backproped.shape[2], inputs.shape[1]]),
        torch.einsum("no,ni->noi", output_gradients, gradient_inputs).flatten(1),
    )
    bias = DenseFactor(
        backproped.flatten(end_dim=1),
        torch.Size([backproped.shape[2]]),
        output_gradients,
    )
    return weight, bias


def _structured(backproped, inputs, output_gradients, gradient_inputs, *, with_kernel):
    if not with_kernel:
        return LinearFactor(backproped, inputs), LinearFactor(backproped, None)
    kernel = gradient_inputs @ inputs.T
    return (
        LinearFactor(backproped, inputs, output_gradients, kernel),
        LinearFactor(backproped, None, output_gradients),
    )


@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: s.id)
def test_gram_and_gradient_products_equal_explicit_ones(shapes):
    tensors = _draw(shapes)
    for explicit, structured in zip(
        _explicit(*tensors), _structured(*tensors, with_kernel=True), strict=True
    ):
        assert_close(structured.gram(), explicit.gram(), name="Gram")
        assert_close(
            structured.gradient_products(),
            explicit.gradient_products(),
            name="gradient products",
        )


@pytest.mark.parametrize("with_kernel", [True, False], ids=["kernel", "mean-grad"])
@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: s.id)
def test_both_routes_to_mean_gradient_products_agree(shapes, with_kernel):
    """``ḡᵀV`` from ``.grad`` or from output gradients and kernel is the same."""
    tensors = _draw(shapes)
    explicit = _explicit(*tensors)
    structured = _structured(*tensors, with_kernel=with_kernel)
    cache = LayerCache()
    for dense, factor in zip(explicit, structured, strict=True):
        mean_gradient = dense.gradients.mean(0).reshape(dense.shape)
        expected = dense.mean_gradient_products(mean_gradient)
        actual = factor.mean_gradient_products(mean_gradient, cache)
        assert_close(actual, expected, name="ḡᵀV")


@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: s.id)
def test_vector_products_equal_explicit_ones(shapes):
    """``xᵀV`` for a batch of parameter-space vectors (the averaged ``BᵀV``)."""
    tensors = _draw(shapes)
    generator = torch.Generator().manual_seed(2)
    for dense, factor in zip(
        _explicit(*tensors), _structured(*tensors, with_kernel=False), strict=True
    ):
        vectors = torch.randn(3, *dense.shape, generator=generator, dtype=torch.float64)
        expected = vectors.flatten(1) @ dense.matrix.T
        assert_close(dense.vector_products(vectors), expected, name="dense xᵀV")
        assert_close(factor.vector_products(vectors), expected, name="xᵀV")


@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: s.id)
def test_apply_equals_explicit_map_and_shares_work(shapes):
    tensors = _draw(shapes)
    generator = torch.Generator().manual_seed(1)
    columns = shapes.num_outputs * shapes.num_samples
    for vectors in (
        torch.randn(columns, generator=generator, dtype=torch.float64),
        torch.randn(columns, 3, generator=generator, dtype=torch.float64),
    ):
        cache = LayerCache()
        for dense, factor in zip(
            _explicit(*tensors), _structured(*tensors, with_kernel=False), strict=True
        ):
            assert_close(factor.apply(vectors, cache), dense.apply(vectors), name="Vβ")
        assert len(cache) == 1  # the bias reused the weight's combination


def test_cost_model_picks_the_kernel_for_wide_inputs_only():
    # MLP 784-128 at N=128: MC-1 (C·N = 128 < 784) vs exact (C·N = 1280 > 784).
    assert mean_products_via_kernel(1, 128, 128, 784, 128, kernel_shared=True)
    assert not mean_products_via_kernel(10, 128, 128, 784, 128, kernel_shared=True)
    # Square layers gain nothing; an unshared kernel costs N'·N·d_in extra.
    assert not mean_products_via_kernel(1, 128, 128, 128, 128, kernel_shared=True)
    assert not mean_products_via_kernel(1, 128, 128, 784, 128, kernel_shared=False)


# Weights shared over positions: columns Σ_p b_cnp x_npᵀ.
SHARED_SHAPES = [  # (C, N, N', P, d_in, d_out)
    pytest.param((3, 4, 4, 2, 6, 5), id="exact-2-positions"),
    pytest.param((1, 5, 3, 4, 4, 3), id="mc1-4-positions-subsampled"),
]


def _draw_shared(shape):
    num_outputs, num_samples, num_gradients, positions, d_in, d_out = shape
    generator = torch.Generator().manual_seed(2)

    def normal(*size):
        return torch.randn(*size, generator=generator, dtype=torch.float64)

    return (
        normal(num_outputs, num_samples, positions, d_out),
        normal(num_samples, positions, d_in),
        normal(num_gradients, positions, d_out),
        normal(num_gradients, positions, d_in),
    )


@pytest.mark.parametrize("shape", SHARED_SHAPES)
def test_shared_factor_equals_explicit_columns(shape):
    backproped, inputs, output_gradients, gradient_inputs = _draw_shared(shape)
    d_out, d_in = backproped.shape[-1], inputs.shape[-1]
    weight_shape = torch.Size([d_out, 2, d_in // 2])  # like a convolution kernel
    explicit = DenseFactor(
        torch.einsum("cnpo,npi->cnoi", backproped, inputs).flatten(2).flatten(0, 1),
        weight_shape,
        torch.einsum("npo,npi->noi", output_gradients, gradient_inputs).flatten(1),
    )
    with_gradients = SharedLinearFactor(
        backproped, inputs, weight_shape, output_gradients, gradient_inputs
    )
    without_gradients = SharedLinearFactor(backproped, inputs, weight_shape)
    assert_close(with_gradients.gram(), explicit.gram(), name="Gram")
    assert_close(
        with_gradients.gradient_products(),
        explicit.gradient_products(),
        name="gradient products",
    )
    mean_gradient = explicit.gradients.mean(0).reshape(weight_shape)
    for factor in (with_gradients, without_gradients):
        assert_close(
            factor.mean_gradient_products(mean_gradient),
            explicit.mean_gradient_products(mean_gradient),
            name="ḡᵀV",
        )
    generator = torch.Generator().manual_seed(3)
    vectors = torch.randn(4, *weight_shape, generator=generator, dtype=torch.float64)
    assert_close(
        without_gradients.vector_products(vectors),
        vectors.flatten(1) @ explicit.matrix.T,
        name="xᵀV",
    )
    columns = backproped.shape[0] * backproped.shape[1]
    vectors = torch.randn(columns, 3, generator=generator, dtype=torch.float64)
    assert_close(without_gradients.apply(vectors), explicit.apply(vectors), name="Vβ")
    assert_close(
        without_gradients.apply(vectors[:, 0]), explicit.apply(vectors[:, 0]), name="Vβ"
    )


@pytest.mark.parametrize("shape", SHARED_SHAPES)
def test_materialized_shared_columns_equal_sums_of_outer_products(shape):
    backproped, inputs, _, _ = _draw_shared(shape)
    num_outputs, num_samples, positions, d_out = backproped.shape
    explicit = torch.zeros(num_outputs, num_samples, d_out, inputs.shape[-1])
    explicit = explicit.to(torch.float64)
    for c in range(num_outputs):
        for n in range(num_samples):
            for p in range(positions):
                explicit[c, n] += torch.outer(backproped[c, n, p], inputs[n, p])
    assert_close(
        shared_weight_sqrt_ggn(backproped, inputs), explicit, name="Σ_p b_cnp x_npᵀ"
    )


def test_cost_model_contracts_few_positions_and_materializes_many():
    # nn.Linear over 2 positions (exact GGN, C=3, N=4): contraction is cheaper.
    assert prefers_structured(3, 4, 2, 12, 6)
    # The benchmark CNN's second convolution (MC-1, N=128, 8×8 positions, 16·5·5
    # inputs): (C·N·P)² = 8192² would dwarf the materialized 128 × 12800 factor.
    assert not prefers_structured(1, 128, 64, 400, 32)
    # One position is a plain linear layer: always cheaper than materializing.
    assert prefers_structured(10, 128, 1, 784, 128)
