"""Self-tests of the tensor comparisons in tests/assertions.py."""

from __future__ import annotations

import pytest
import torch

from tests.assertions import (
    assert_close,
    assert_close_up_to_sign,
    assert_close_with_direction_signs,
)


def test_assert_close_passes_within_tolerance():
    expected = torch.tensor([1.0, -2.0, 0.0], dtype=torch.float64)
    assert_close(expected * (1 + 5e-8) + 5e-11, expected)


def test_assert_close_reports_the_worst_element():
    expected = torch.zeros(2, 3, dtype=torch.float64)
    actual = expected.clone()
    actual[1, 2] = 1e-3
    actual[0, 1] = 1e-9
    with pytest.raises(AssertionError) as error:
        assert_close(actual, expected, name="quantity")
    message = str(error.value)
    for expected_text in (
        "quantity",
        "2 of 6 elements",
        "max abs diff: 1.000000e-03",
        "index (1, 2)",
        "atol=1e-10",
        "rtol=1e-07",
    ):
        assert expected_text in message


def test_assert_close_rejects_shape_dtype_and_nan_mismatches():
    values = torch.ones(3, dtype=torch.float64)
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_close(values, torch.ones(2, dtype=torch.float64))
    with pytest.raises(AssertionError, match="dtype mismatch"):
        assert_close(values, values.float())
    with pytest.raises(AssertionError, match="1 of 3 elements"):
        assert_close(torch.tensor([1.0, float("nan"), 1.0]).double(), values)


def test_assert_close_up_to_sign_flips_whole_vectors_only():
    generator = torch.Generator().manual_seed(1)
    vectors = torch.linalg.qr(
        torch.randn(5, 3, generator=generator, dtype=torch.float64)
    ).Q
    flipped = vectors * torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64)
    assert_close_up_to_sign(flipped, vectors, dim=-1)
    assert_close_up_to_sign(flipped.T, vectors.T, dim=0)
    partly_flipped = vectors.clone()
    partly_flipped[0, 1] *= -1
    with pytest.raises(AssertionError, match="sign-aligned"):
        assert_close_up_to_sign(partly_flipped, vectors, dim=-1)


def test_assert_close_with_direction_signs_requires_consistent_signs():
    generator = torch.Generator().manual_seed(2)
    directions = torch.linalg.qr(
        torch.randn(5, 2, generator=generator, dtype=torch.float64)
    ).Q
    grads = torch.randn(4, 5, generator=generator, dtype=torch.float64)
    signs = torch.tensor([-1.0, 1.0], dtype=torch.float64)
    assert_close_with_direction_signs(
        grads @ (directions * signs),
        grads @ directions,
        actual_directions=directions * signs,
        expected_directions=directions,
    )
    with pytest.raises(AssertionError):
        assert_close_with_direction_signs(
            grads @ (directions * signs),
            grads @ directions,
            actual_directions=directions,
            expected_directions=directions,
        )
