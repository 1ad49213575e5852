"""Square-root factors ``V_p`` of one parameter's GGN block (pure tensor math).

Both kinds expose the same three operations a GGN block needs: the Gram contribution
``V_pᵀ V_p``, the products ``g_nᵀ V_p`` with per-sample gradients, and the map of
Gram-space vectors to parameter space ``V_p β``.

* :class:`DenseFactor` holds ``V_p`` as a ``[C·N, D_p]`` matrix (any layer).
* :class:`LinearFactor` exploits ``nn.Linear``'s structure: the column ``(c, n)`` of
  the weight's ``V_p`` is ``b_cn x_nᵀ`` (``b_cn`` the back-propagated square-root
  column at the layer output, ``x_n`` the layer input), so inner products factorize,
  ``⟨b_cn x_nᵀ, b_c'm x_mᵀ⟩ = (b_cnᵀ b_c'm)(x_nᵀ x_m)``, and nothing of size
  ``C·N·D_p`` is ever formed. The bias's column is ``b_cn`` (``x_n ≡ 1``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Size, Tensor


def flatten_sqrt_ggn(sqrt_ggn: Tensor) -> Tensor:
    """Flatten BackPACK's square root ``[C, N, *p.shape]`` to ``V_p`` as ``[C·N, D_p]``.

    Args:
        sqrt_ggn: Square root of one parameter's GGN block.

    Returns:
        Matrix whose row ``c·N + n`` is the column ``(c, n)`` of ``V_p``.
    """
    return sqrt_ggn.flatten(start_dim=2).flatten(end_dim=1)


def _as_columns(vectors: Tensor) -> tuple[Tensor, tuple[int, ...]]:
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

    def gram(self, shared: dict | None = None) -> Tensor:
        """Return the Gram contribution ``V_pᵀ V_p`` (``[C·N, C·N]``; no memo)."""
        return self.matrix @ self.matrix.T

    def gradient_products(self, shared: dict | None = None) -> Tensor:
        """Return ``g_nᵀ V_p`` for every per-sample gradient (``[N', C·N]``)."""
        return self.gradients @ self.matrix.T

    def mean_gradient_products(self, gradient: Tensor) -> Tensor:
        """Return ``ḡᵀ V_p`` for one (mean) gradient shaped like the parameter.

        Args:
            gradient: The parameter's gradient.

        Returns:
            ``[1, C·N]`` products.
        """
        return gradient.reshape(1, -1) @ self.matrix.T

    def apply(self, vectors: Tensor) -> Tensor:
        """Map Gram-space vectors ``[C·N(, K)]`` to ``p.shape`` (``[K, *p.shape]``)."""
        columns, leading = _as_columns(vectors)
        return (columns.T @ self.matrix).reshape(*leading, *self.shape)


@dataclass
class LinearFactor:
    """The Kronecker-structured square-root factor of an ``nn.Linear`` parameter.

    Attributes:
        backproped: Back-propagated square root at the layer output ``[C, N, d_out]``.
        inputs: Layer inputs of the same ``N`` samples ``[N, d_in]``; ``None`` for
            the bias.
        output_gradients: Per-sample output gradients ``∇_out ℓ_n`` ``[N', d_out]``,
            if gradients are needed.
        gradient_inputs: Layer inputs of those ``N'`` samples (``None`` for the bias).
    """

    backproped: Tensor
    inputs: Tensor | None
    output_gradients: Tensor | None = None
    gradient_inputs: Tensor | None = None

    def drop_gradients(self) -> None:
        """Release the per-sample gradient data once their products are formed."""
        self.output_gradients = self.gradient_inputs = None

    @property
    def _rows(self) -> Tensor:
        return self.backproped.flatten(end_dim=1)

    def gram(self, shared: dict | None = None) -> Tensor:
        """Return ``(B Bᵀ) ⊙ (X Xᵀ ⊗ 1_{C×C})`` without forming ``V_p``.

        Args:
            shared: Optional memo for the factors of one layer: the weight and the
                bias share ``B Bᵀ``. Keys are object identities, so the caller must
                keep it no longer than the tensors live (one layer).

        Returns:
            The ``[C·N, C·N]`` Gram contribution.
        """
        outer = memo(shared, ("BBᵀ", id(self.backproped)), self._outer)
        if self.inputs is None:
            return outer
        num_outputs = self.backproped.shape[0]
        kernel = memo(
            shared, ("XXᵀ", id(self.inputs)), lambda: self.inputs @ self.inputs.T
        )
        return outer * kernel.repeat(num_outputs, num_outputs)

    def gradient_products(self, shared: dict | None = None) -> Tensor:
        """Return ``(δ_nᵀ b_cm)(x_nᵀ x_m)`` for the gradient samples ``[N', C·N]``.

        Args:
            shared: Optional memo, as for :meth:`gram`.

        Returns:
            The ``[N', C·N]`` products with the per-sample gradients.
        """
        products = memo(
            shared,
            ("δBᵀ", id(self.output_gradients), id(self.backproped)),
            lambda: self.output_gradients @ self._rows.T,
        )
        if self.inputs is None:
            return products
        num_outputs = self.backproped.shape[0]
        if self.gradient_inputs is self.inputs:  # same samples: the Gram's kernel
            kernel = memo(
                shared, ("XXᵀ", id(self.inputs)), lambda: self.inputs @ self.inputs.T
            )
        else:
            kernel = memo(
                shared,
                ("X'Xᵀ", id(self.gradient_inputs), id(self.inputs)),
                lambda: self.gradient_inputs @ self.inputs.T,
            )
        return products * kernel.repeat(1, num_outputs)

    def mean_gradient_products(self, gradient: Tensor) -> Tensor:
        """Return ``ḡᵀ V_p``: ``b_cmᵀ ḡ_W x_m`` (weight) or ``b_cmᵀ ḡ_b`` (bias).

        Args:
            gradient: The parameter's gradient ``[d_out, d_in]`` or ``[d_out]``.

        Returns:
            ``[1, C·N]`` products.
        """
        if self.inputs is None:
            products = self.backproped @ gradient
        else:
            products = torch.einsum(
                "cmo,mo->cm", self.backproped, self.inputs @ gradient.T
            )
        return products.reshape(1, -1)

    def _outer(self) -> Tensor:
        return self._rows @ self._rows.T

    def apply(self, vectors: Tensor) -> Tensor:
        """Map Gram-space vectors: ``Σ_cn β_cn b_cn x_nᵀ`` as one matrix product."""
        columns, leading = _as_columns(vectors)
        num_outputs, num_samples, _ = self.backproped.shape
        weights = columns.reshape(num_outputs, num_samples, -1)
        # w[k, n, o] = Σ_c β_k[c, n] b[c, n, o]
        combined = torch.einsum("cnk,cno->kno", weights, self.backproped)
        if self.inputs is None:
            result = combined.sum(1)
        else:
            result = combined.transpose(1, 2) @ self.inputs
        return result.reshape(*leading, *result.shape[1:])


def memo(shared: dict | None, key: tuple, compute: Callable[[], Tensor]) -> Tensor:
    """Return ``shared[key]``, computing and storing it on first use.

    Args:
        shared: The memo, or ``None`` to always compute.
        key: Identities of the inputs (valid only while they are alive).
        compute: Produces the value.

    Returns:
        The (possibly memoized) value.
    """
    if shared is None:
        return compute()
    if key not in shared:
        shared[key] = compute()
    return shared[key]
