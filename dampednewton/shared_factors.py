"""Square-root factors of weights shared over positions (pure tensor math).

A linear layer applied at ``P`` positions (a sequence model's ``nn.Linear`` on
``[N, P, d_in]`` inputs, a convolution on its unfolded input) has the weight column
``(c, n)`` of ``V`` equal to ``Σ_p b_cnp x_npᵀ``, so inner products contract over pairs
of positions: ``⟨Σ_p b_cnp x_npᵀ, Σ_q b_dmq x_mqᵀ⟩ = Σ_pq (b_cnpᵀ b_dmq)(x_npᵀ x_mq)``.
That beats materializing ``V`` only for few positions, which
:func:`prefers_structured` decides per layer from the cost model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Size, Tensor

from dampednewton.factors import as_columns, memo


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


def _rows(tensor: Tensor) -> Tensor:
    """``[..., P, d]`` to one row per (leading index, position) ``[-1, d]``."""
    return tensor.reshape(-1, tensor.shape[-1])


@dataclass
class SharedLinearFactor:
    """The square-root factor of a weight shared over ``P`` positions.

    Attributes:
        backproped: Back-propagated square root at the outputs ``[C, N, P, d_out]``.
        inputs: Inputs (unfolded for convolutions) of the same samples ``[N, P, d_in]``.
        shape: The parameter's shape (``d_out·d_in`` entries).
        output_gradients: Per-sample output gradients ``∇_out ℓ_n`` ``[N', P, d_out]``
            of the gradient samples, if needed.
        gradient_inputs: Their inputs ``[N', P, d_in]``.
    """

    backproped: Tensor
    inputs: Tensor
    shape: Size
    output_gradients: Tensor | None = None
    gradient_inputs: Tensor | None = None

    def drop_gradients(self) -> None:
        """Release the per-sample gradient data once their products are formed."""
        self.output_gradients = self.gradient_inputs = None

    def gram(self, shared: dict | None = None) -> Tensor:
        """Return ``Σ_pq (b_cnpᵀ b_dmq)(x_npᵀ x_mq)`` as ``[C·N, C·N]``.

        Args:
            shared: Optional memo of one layer (keys are object identities).

        Returns:
            The Gram contribution.
        """
        num_outputs, num_samples, positions, _ = self.backproped.shape
        rows = _rows(self.backproped)
        kernel = memo(shared, ("XXᵀ", id(self.inputs)), self._input_kernel)
        size = (num_outputs, num_samples, positions) * 2
        products = (rows @ rows.T).view(size) * kernel.view(1, *size[1:3], 1, *size[4:])
        columns = num_outputs * num_samples
        return products.sum(dim=(2, 5)).reshape(columns, columns)

    def gradient_products(self, shared: dict | None = None) -> Tensor:
        """Return ``Σ_pq (δ_npᵀ b_cmq)(x'_npᵀ x_mq)`` for the gradient samples.

        Args:
            shared: Optional memo of one layer.

        Returns:
            ``[N', C·N]`` products with the per-sample gradients.
        """
        num_outputs, num_samples, positions, _ = self.backproped.shape
        num_gradients = self.output_gradients.shape[0]
        if self.gradient_inputs is self.inputs:
            kernel = memo(shared, ("XXᵀ", id(self.inputs)), self._input_kernel)
        else:
            kernel = _rows(self.gradient_inputs) @ _rows(self.inputs).T
        products = _rows(self.output_gradients) @ _rows(self.backproped).T
        blocks = products.view(
            num_gradients, positions, num_outputs, num_samples, positions
        ) * kernel.view(num_gradients, positions, 1, num_samples, positions)
        return blocks.sum(dim=(1, 4)).reshape(num_gradients, -1)

    def mean_gradient_products(
        self, gradient: Tensor, shared: dict | None = None
    ) -> Tensor:
        """Return ``ḡᵀ V_p = Σ_q b_cmqᵀ ḡ x_mq`` for the mean gradient.

        Args:
            gradient: The parameter's mean gradient (``shape``).
            shared: Optional memo of one layer.

        Returns:
            ``[1, C·N]`` products.
        """
        if self.output_gradients is not None:
            return self.gradient_products(shared).mean(0, keepdim=True)
        return self.vector_products(gradient.unsqueeze(0))

    def vector_products(self, vectors: Tensor) -> Tensor:
        """Return ``xᵀ V_p = Σ_q b_cmqᵀ x x_mq`` for vectors ``[K, *shape]``.

        Args:
            vectors: ``K`` vectors shaped like the parameter.

        Returns:
            ``[K, C·N]`` products.
        """
        out_features = self.backproped.shape[-1]
        matrices = vectors.reshape(vectors.shape[0], out_features, -1)
        mapped = torch.einsum("mqi,koi->kmqo", self.inputs, matrices)
        products = torch.einsum("cmqo,kmqo->kcm", self.backproped, mapped)
        return products.reshape(vectors.shape[0], -1)

    def apply(self, vectors: Tensor, shared: dict | None = None) -> Tensor:
        """Map Gram-space vectors: ``Σ_cn β_cn Σ_p b_cnp x_npᵀ`` as one product.

        Args:
            vectors: ``[C·N]`` or ``[C·N, K]``.
            shared: Unused (the interface of the other factors).

        Returns:
            ``[*shape]`` or ``[K, *shape]``.
        """
        columns, leading = as_columns(vectors)
        num_outputs, num_samples, positions, out_features = self.backproped.shape
        weights = columns.reshape(num_outputs, num_samples, -1)
        combined = torch.einsum("cnk,cnpo->knpo", weights, self.backproped)
        combined = combined.reshape(-1, num_samples * positions, out_features)
        result = combined.transpose(1, 2) @ _rows(self.inputs)
        return result.reshape(*leading, *self.shape)

    def _input_kernel(self) -> Tensor:
        rows = _rows(self.inputs)
        return rows @ rows.T
