"""Tensor comparisons with informative mismatch reports.

Elements match if ``|actual − expected| ≤ atol + rtol·|expected|`` (as in
``torch.allclose``); NaNs never match. Shapes and dtypes must agree exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor


def assert_close(
    actual: Tensor,
    expected: Tensor,
    *,
    rtol: float = 1e-7,
    atol: float = 1e-10,
    name: str = "",
) -> None:
    """Assert that two tensors agree elementwise.

    Args:
        actual: Computed tensor.
        expected: Reference tensor, same shape and dtype.
        rtol: Relative tolerance (w.r.t. ``|expected|``).
        atol: Absolute tolerance.
        name: Name of the compared quantity, shown in the report.

    Raises:
        AssertionError: If shapes or dtypes differ or an element is out of
            tolerance. The message gives the shapes, the number of mismatches, the
            largest absolute and relative differences, the worst element's index and
            both values there, and the tolerances.
    """
    label = f"{name}: " if name else ""
    if actual.shape != expected.shape:
        raise AssertionError(
            f"{label}shape mismatch: actual {tuple(actual.shape)}, "
            f"expected {tuple(expected.shape)}."
        )
    if actual.dtype != expected.dtype:
        raise AssertionError(
            f"{label}dtype mismatch: actual {actual.dtype}, expected {expected.dtype}."
        )
    if actual.numel() == 0:
        return
    actual64 = actual.detach().cpu().to(torch.float64)
    expected64 = expected.detach().cpu().to(torch.float64)
    diff = (actual64 - expected64).abs()
    allowed = atol + rtol * expected64.abs()
    # NaN differences count as infinitely bad.
    violation = torch.where(diff.isnan(), torch.inf, diff / allowed)
    num_bad = int((violation > 1).sum())
    if num_bad == 0:
        return
    worst = int(violation.flatten().argmax())
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
    relative = torch.where(diff == 0, 0.0, diff / expected64.abs())
    raise AssertionError(
        f"{label}{num_bad} of {diff.numel()} elements differ beyond "
        f"atol={atol:g} + rtol={rtol:g}·|expected| (shape {tuple(diff.shape)}, "
        f"dtype {actual.dtype}).\n"
        f"  max abs diff: {diff.nan_to_num(nan=torch.inf).max().item():.6e}\n"
        f"  max rel diff: {relative.nan_to_num(nan=torch.inf).max().item():.6e}\n"
        f"  worst element at index {index}: actual {actual64[index].item():.17g}, "
        f"expected {expected64[index].item():.17g} "
        f"(abs diff {diff[index].item():.6e}, allowed {allowed[index].item():.6e})"
    )


def sign_alignment(actual: Tensor, expected: Tensor, dim: int) -> Tensor:
    """Signs (±1) that align each vector of ``actual`` with that of ``expected``.

    The sign of vector ``j`` is that of the dot product of
    ``actual.select(dim, j)`` and ``expected.select(dim, j)`` (+1 if it is zero).

    Args:
        actual: Computed vectors.
        expected: Reference vectors, same shape.
        dim: Dimension that enumerates the vectors, e.g. ``-1`` for eigenvectors
            stored as columns ``[D, k]``.

    Returns:
        Signs of shape ``[actual.shape[dim]]``, same dtype as ``actual``.

    Raises:
        AssertionError: If the shapes differ.
    """
    if actual.shape != expected.shape:
        raise AssertionError(
            f"shape mismatch: actual {tuple(actual.shape)}, "
            f"expected {tuple(expected.shape)}."
        )
    products = actual * expected.to(actual.dtype)
    other_dims = [d for d in range(actual.dim()) if d != dim % actual.dim()]
    dots = products.sum(dim=other_dims) if other_dims else products
    return torch.where(dots < 0, -1.0, 1.0).to(actual.dtype)


def assert_close_up_to_sign(
    actual: Tensor,
    expected: Tensor,
    dim: int,
    *,
    rtol: float = 1e-7,
    atol: float = 1e-10,
    name: str = "",
) -> None:
    """Assert that vectors agree up to one sign flip per vector (e.g. eigenvectors).

    Args:
        actual: Computed vectors.
        expected: Reference vectors, same shape and dtype.
        dim: Dimension that enumerates the vectors, e.g. ``-1`` for eigenvectors
            stored as columns ``[D, k]``.
        rtol: Relative tolerance.
        atol: Absolute tolerance.
        name: Name of the compared quantity, shown in the report.

    Raises:
        AssertionError: If no choice of signs makes the tensors close.
    """
    signs = sign_alignment(actual, expected, dim)
    assert_close(
        actual * _broadcast(signs, actual.dim(), dim),
        expected,
        rtol=rtol,
        atol=atol,
        name=f"{name} (sign-aligned along dim {dim})",
    )


def assert_close_with_direction_signs(
    actual: Tensor,
    expected: Tensor,
    *,
    actual_directions: Tensor,
    expected_directions: Tensor,
    rtol: float = 1e-7,
    atol: float = 1e-10,
    name: str = "",
) -> None:
    """Assert that per-direction quantities agree after aligning the directions.

    For quantities that flip sign with their direction, such as
    ``gammas[n, j] = ∇ℓ_n · e_j``: the sign of column ``j`` is the one that aligns
    ``actual_directions[:, j]`` with ``expected_directions[:, j]``. This checks that
    ``actual`` is consistent with its own directions, which is stricter than
    aligning the signs of ``actual`` by itself.

    Args:
        actual: Computed values, shape ``[..., k]``.
        expected: Reference values, same shape and dtype.
        actual_directions: Directions used for ``actual``, shape ``[D, k]``.
        expected_directions: Reference directions, shape ``[D, k]``.
        rtol: Relative tolerance.
        atol: Absolute tolerance.
        name: Name of the compared quantity, shown in the report.

    Raises:
        AssertionError: If the values differ after the sign alignment.
    """
    signs = sign_alignment(actual_directions, expected_directions, dim=-1)
    if actual.dim() == 0 or actual.shape[-1] != signs.numel():
        raise AssertionError(
            f"{name}: last dimension of shape {tuple(actual.shape)} must enumerate "
            f"the {signs.numel()} directions."
        )
    assert_close(
        actual * signs.to(actual.dtype),
        expected,
        rtol=rtol,
        atol=atol,
        name=f"{name} (signs of the aligned directions)",
    )


def assert_scalar(actual: float, expected: Tensor | float, name: str, **tols) -> None:
    """Assert that a float (a record entry) matches a scalar reference in float64."""
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert_close(torch.tensor(actual, dtype=torch.float64), expected, name=name, **tols)


def _broadcast(signs: Tensor, ndim: int, dim: int) -> Tensor:
    shape = [1] * ndim
    shape[dim] = -1
    return signs.view(shape)
