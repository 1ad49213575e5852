"""Cost models: multiply-add counts that pick the cheaper of two exact routes."""

from __future__ import annotations

PARTIAL_MIN_SIZE = 512
"""Smallest Gram matrix on which the partial (Krylov) eigensolver may pay off."""

PARTIAL_MAX_FRACTION = 1 / 16
"""Largest fraction of the eigenpairs for which the partial eigensolver pays off."""


def prefers_partial_eigensolver(size: int, wanted: int) -> bool:
    """Whether the leading ``wanted`` eigenpairs of a ``size²`` matrix are worth Krylov.

    Args:
        size: Rows of the symmetric matrix.
        wanted: Number of leading eigenpairs needed.

    Returns:
        ``True`` for large matrices and few eigenpairs.
    """
    return size >= PARTIAL_MIN_SIZE and wanted <= PARTIAL_MAX_FRACTION * size


def prefers_structured(
    num_outputs: int,
    num_samples: int,
    positions: int,
    in_features: int,
    out_features: int,
) -> bool:
    """Whether contracting over positions is cheaper than materializing ``V``.

    Multiply-adds and memory of the two Gram routes for a ``[d_out, d_in]`` weight
    shared over ``P`` positions, with ``C`` columns for each of ``N`` samples:

    * materialized: ``V`` as ``[C·N, d_out·d_in]`` costs ``C·N·P·d_out·d_in`` to form
      and ``(C·N)²·d_out·d_in`` for ``V Vᵀ``; it holds ``C·N·d_out·d_in`` numbers;
    * structured: ``(C·N·P)²·(d_out + 1)`` for ``B Bᵀ`` and the contraction, and
      ``(N·P)²·d_in`` for the input kernel; it holds ``(C·N·P)² + (N·P)²`` numbers.

    Args:
        num_outputs: ``C``.
        num_samples: ``N``.
        positions: ``P``.
        in_features: ``d_in`` (channels times kernel size for a convolution).
        out_features: ``d_out``.

    Returns:
        ``True`` if the structured route needs fewer multiply-adds and no more memory.
    """
    columns = num_outputs * num_samples
    weight_size = out_features * in_features
    rows, input_rows = columns * positions, num_samples * positions
    structured = rows**2 * (out_features + 1) + input_rows**2 * in_features
    materialized = columns * positions * weight_size + columns**2 * weight_size
    memory_ok = rows**2 + input_rows**2 <= columns * weight_size
    return structured < materialized and memory_ok


def mean_products_via_kernel(
    num_outputs: int,
    num_samples: int,
    num_gradient_samples: int,
    in_features: int,
    out_features: int,
    *,
    kernel_shared: bool,
) -> bool:
    """Whether a linear layer's ``ḡᵀV`` is cheaper from output gradients and kernel.

    Multiply-adds of the two routes (``C`` columns per sample, ``N`` GGN and ``N'``
    gradient samples):

    * from the mean gradient: ``ḡ_W x_m`` for every GGN sample, ``N·d_in·d_out``,
      then ``C·N·d_out`` inner products;
    * from output gradients: ``δ Bᵀ`` costs ``N'·C·N·d_out``, weighting it by the
      input kernel ``N'·C·N``, and the kernel itself ``N'·N·d_in`` unless the Gram
      matrix's ``X Xᵀ`` serves (same samples).

    Args:
        num_outputs: ``C``.
        num_samples: ``N``.
        num_gradient_samples: ``N'``.
        in_features: ``d_in``.
        out_features: ``d_out``.
        kernel_shared: Whether the kernel is the Gram matrix's ``X Xᵀ``.

    Returns:
        ``True`` when the output-gradient route needs fewer multiply-adds.
    """
    columns = num_outputs * num_samples
    direct = num_samples * out_features * (in_features + num_outputs)
    via_kernel = num_gradient_samples * columns * (out_features + 1)
    if not kernel_shared:
        via_kernel += num_gradient_samples * num_samples * in_features
    return via_kernel < direct
