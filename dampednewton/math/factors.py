"""Square-root factors ``V_p`` of one parameter's GGN block (pure tensor math).

Every factor implements :class:`Factor`: the Gram contribution ``V_pᵀ V_p``, the
products ``g_nᵀ V_p`` with per-sample gradients, ``ḡᵀ V_p`` with the mean gradient,
``xᵀ V_p`` with parameter-space vectors, and the map ``V_p β`` of Gram-space vectors
to parameter space. A layer's weight and bias factors share intermediate products
through a :class:`LayerCache`.

* :class:`DenseFactor` holds ``V_p`` as a ``[C·N, D_p]`` matrix (any layer).
* :mod:`dampednewton.math.linear_factors` exploits the Kronecker structure of linear
  layers and convolutions instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from torch import Size, Tensor


class Product(Enum):
    """Intermediate products that the factors of one layer share."""

    RESCALED = "√(N/N_ggn) B"
    OUTER = "B Bᵀ"
    INPUT_KERNEL = "X Xᵀ"
    CROSS_KERNEL = "X' Xᵀ"
    OUTPUT_GRADIENTS = "N δ"
    OUTPUT_GRADIENT_PRODUCTS = "δ Bᵀ"
    COMBINED = "β B"


class LayerCache:
    """Products shared by the factors of one layer, each computed once.

    Entries are keyed by the :class:`Product` and the identities of its input
    tensors, so a cache must not outlive those tensors: create one per layer (hook
    call) or per mapping of Gram-space vectors.
    """

    def __init__(self) -> None:
        """Start empty."""
        self._values: dict[tuple[Product, tuple[int, ...]], Tensor] = {}

    def __len__(self) -> int:
        """Number of cached products."""
        return len(self._values)

    def get(
        self,
        product: Product,
        inputs: tuple[Tensor | None, ...],
        compute: Callable[[], Tensor],
    ) -> Tensor:
        """Return the product of ``inputs``, computing and storing it on first use.

        Args:
            product: Which product.
            inputs: The tensors it is computed from.
            compute: Produces the value.

        Returns:
            The (possibly cached) value.
        """
        key = (product, tuple(id(tensor) for tensor in inputs))
        if key not in self._values:
            self._values[key] = compute()
        return self._values[key]


def cached(
    cache: LayerCache | None,
    product: Product,
    inputs: tuple[Tensor | None, ...],
    compute: Callable[[], Tensor],
) -> Tensor:
    """:meth:`LayerCache.get`, or just ``compute()`` without a cache.

    Args:
        cache: The layer's cache, or ``None`` to always compute.
        product: Which product.
        inputs: The tensors it is computed from.
        compute: Produces the value.

    Returns:
        The (possibly cached) value.
    """
    if cache is None:
        return compute()
    return cache.get(product, inputs, compute)


class Factor(Protocol):
    """What a GGN block needs from one parameter's square-root factor ``V_p``."""

    def gram(self, cache: LayerCache | None = None) -> Tensor:
        """Return the Gram contribution ``V_pᵀ V_p`` (``[C·N, C·N]``)."""
        ...

    def gradient_products(self, cache: LayerCache | None = None) -> Tensor:
        """Return ``g_nᵀ V_p`` for the per-sample gradients (``[N', C·N]``)."""
        ...

    def mean_gradient_products(
        self, gradient: Tensor, cache: LayerCache | None = None
    ) -> Tensor:
        """Return ``ḡᵀ V_p`` for the mean gradient shaped like the parameter."""
        ...

    def vector_products(self, vectors: Tensor) -> Tensor:
        """Return ``xᵀ V_p`` for vectors ``[K, *p.shape]`` (``[K, C·N]``)."""
        ...

    def apply(self, vectors: Tensor, cache: LayerCache | None = None) -> Tensor:
        """Map Gram-space vectors ``[C·N(, K)]`` to ``p.shape`` (``[K, *p.shape]``)."""
        ...

    def drop_gradients(self) -> None:
        """Release the per-sample gradient data once their products are formed."""
        ...


def gathered(tensor: Tensor | None, name: str) -> Tensor:
    """Optional per-sample gradient data that a gradient product needs.

    Args:
        tensor: The data (``None`` if not gathered, or already dropped).
        name: The field's name, for the error.

    Returns:
        The tensor.

    Raises:
        RuntimeError: If the factor holds no such data.
    """
    if tensor is None:
        raise RuntimeError(
            f"No {name}: they were not gathered (no gradient samples requested) "
            "or already dropped."
        )
    return tensor


def flatten_sqrt_ggn(sqrt_ggn: Tensor) -> Tensor:
    """Flatten BackPACK's square root ``[C, N, *p.shape]`` to ``V_p`` as ``[C·N, D_p]``.

    Args:
        sqrt_ggn: Square root of one parameter's GGN block.

    Returns:
        Matrix whose row ``c·N + n`` is the column ``(c, n)`` of ``V_p``.
    """
    return sqrt_ggn.flatten(start_dim=2).flatten(end_dim=1)


def as_columns(vectors: Tensor) -> tuple[Tensor, tuple[int, ...]]:
    """View a Gram-space vector ``[C·N]`` or matrix ``[C·N, K]`` as columns.

    Args:
        vectors: One vector or ``K`` of them as columns.

    Returns:
        ``[C·N, K']`` columns and the leading shape of the mapped result (``()`` or
        ``(K,)``).
    """
    if vectors.dim() == 1:
        return vectors.unsqueeze(1), ()
    return vectors, (vectors.shape[1],)


@dataclass
class DenseFactor:
    """A materialized square-root factor.

    Attributes:
        matrix: ``V_p`` as ``[C·N, D_p]`` (rows indexed by ``c·N + n``).
        shape: The parameter's shape.
        gradients: Per-sample gradients ``[N', D_p]`` (of ``ℓ_n``), if needed.
    """

    matrix: Tensor
    shape: Size
    gradients: Tensor | None = None

    def drop_gradients(self) -> None:
        """Release the per-sample gradients once their products are formed."""
        self.gradients = None

    def gram(self, cache: LayerCache | None = None) -> Tensor:
        """Return the Gram contribution ``V_pᵀ V_p`` (``[C·N, C·N]``; no memo)."""
        return self.matrix @ self.matrix.T

    def gradient_products(self, cache: LayerCache | None = None) -> Tensor:
        """Return ``g_nᵀ V_p`` for every per-sample gradient (``[N', C·N]``)."""
        return gathered(self.gradients, "gradients") @ self.matrix.T

    def mean_gradient_products(
        self, gradient: Tensor, cache: LayerCache | None = None
    ) -> Tensor:
        """Return ``ḡᵀ V_p`` for one (mean) gradient shaped like the parameter.

        Args:
            gradient: The parameter's gradient.
            cache: Unused (the interface of :class:`Factor`).

        Returns:
            ``[1, C·N]`` products.
        """
        return self.vector_products(gradient.unsqueeze(0))

    def vector_products(self, vectors: Tensor) -> Tensor:
        """Return ``xᵀ V_p`` for parameter-space vectors ``[K, *p.shape]``.

        Args:
            vectors: ``K`` vectors shaped like the parameter.

        Returns:
            ``[K, C·N]`` products.
        """
        return vectors.reshape(vectors.shape[0], -1) @ self.matrix.T

    def apply(self, vectors: Tensor, cache: LayerCache | None = None) -> Tensor:
        """Map Gram-space vectors ``[C·N(, K)]`` to ``p.shape`` (``[K, *p.shape]``).

        Args:
            vectors: ``[C·N]`` or ``[C·N, K]``.
            cache: Unused (the interface of :class:`Factor`).

        Returns:
            ``[*p.shape]`` or ``[K, *p.shape]``.
        """
        columns, leading = as_columns(vectors)
        return (columns.T @ self.matrix).reshape(*leading, *self.shape)
