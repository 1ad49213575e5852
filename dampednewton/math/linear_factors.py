"""Kronecker-structured square-root factors of linear layers (pure tensor math).

* :class:`LinearFactor`: ``nn.Linear`` on ``[N, d_in]`` inputs. The column ``(c, n)``
  of the weight's ``V_p`` is ``b_cn x_nᵀ`` (``b_cn`` the back-propagated square-root
  column at the layer output, ``x_n`` the layer input), so inner products factorize,
  ``⟨b_cn x_nᵀ, b_c'm x_mᵀ⟩ = (b_cnᵀ b_c'm)(x_nᵀ x_m)``, and nothing of size
  ``C·N·D_p`` is ever formed. The bias's column is ``b_cn`` (``x_n ≡ 1``).
* :class:`SharedLinearFactor`: a weight applied at ``P`` positions (a sequence
  model's ``nn.Linear`` on ``[N, P, d_in]`` inputs, a convolution on its unfolded
  input) has the column ``Σ_p b_cnp x_npᵀ``, so inner products contract over pairs
  of positions: ``⟨Σ_p b_cnp x_npᵀ, Σ_q b_dmq x_mqᵀ⟩ = Σ_pq (b_cnpᵀ b_dmq)(x_npᵀ
  x_mq)``. That beats materializing ``V`` only for few positions, which
  :func:`~dampednewton.math.cost.prefers_structured` decides per layer.

Both implement :class:`~dampednewton.math.factors.Factor`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Size, Tensor

from dampednewton.math.factors import (
    LayerCache,
    Product,
    as_columns,
    cached,
    gathered,
)


@dataclass
class LinearFactor:
    """The Kronecker-structured square-root factor of an ``nn.Linear`` parameter.

    Attributes:
        backproped: Back-propagated square root at the layer output ``[C, N, d_out]``.
        inputs: Layer inputs of the same ``N`` samples ``[N, d_in]``; ``None`` for
            the bias.
        output_gradients: Per-sample output gradients ``δ_n = ∇_out ℓ_n``
            ``[N', d_out]`` of the gradient samples, when gradient products are
            formed from them.
        kernel: Input kernel ``x'_nᵀ x_m`` of gradient and GGN samples ``[N', N]``
            (the weight's companion of ``output_gradients``; ``None`` for the bias).
    """

    backproped: Tensor
    inputs: Tensor | None
    output_gradients: Tensor | None = None
    kernel: Tensor | None = None

    def drop_gradients(self) -> None:
        """Release the per-sample gradient data once their products are formed."""
        self.output_gradients = self.kernel = None

    @property
    def _rows(self) -> Tensor:
        return self.backproped.flatten(end_dim=1)

    def gram(self, cache: LayerCache | None = None) -> Tensor:
        """Return ``(B Bᵀ) ⊙ (X Xᵀ ⊗ 1_{C×C})`` without forming ``V_p``.

        Args:
            cache: Optional cache of one layer: the weight and the bias share
                ``B Bᵀ``.

        Returns:
            The ``[C·N, C·N]`` Gram contribution.
        """
        outer = cached(cache, Product.OUTER, (self.backproped,), self._outer)
        inputs = self.inputs
        if inputs is None:
            return outer
        num_outputs, num_samples, _ = self.backproped.shape
        kernel = cached(
            cache,
            Product.INPUT_KERNEL,
            (inputs,),
            lambda: inputs @ inputs.T,
        )
        blocks = outer.view(num_outputs, num_samples, num_outputs, num_samples)
        return (blocks * kernel.view(1, num_samples, 1, num_samples)).view_as(outer)

    def gradient_products(self, cache: LayerCache | None = None) -> Tensor:
        """Return ``(δ_nᵀ b_cm)(x'_nᵀ x_m)`` for the gradient samples ``[N', C·N]``.

        Args:
            cache: Optional cache, as for :meth:`gram`: the bias's products are the
                weight's before the kernel is applied.

        Returns:
            The ``[N', C·N]`` products with the per-sample gradients.
        """
        output_gradients = gathered(self.output_gradients, "output gradients")
        products = cached(
            cache,
            Product.OUTPUT_GRADIENT_PRODUCTS,
            (output_gradients, self.backproped),
            lambda: output_gradients @ self._rows.T,
        )
        if self.inputs is None:
            return products
        num_outputs, num_samples, _ = self.backproped.shape
        blocks = products.view(-1, num_outputs, num_samples)
        kernel = gathered(self.kernel, "input kernel")
        return (blocks * kernel.unsqueeze(1)).view_as(products)

    def mean_gradient_products(
        self, gradient: Tensor, cache: LayerCache | None = None
    ) -> Tensor:
        """``ḡᵀ V_p``: ``b_cmᵀ ḡ_W x_m`` or ``b_cmᵀ ḡ_b``; see :func:`mean_products`."""
        return mean_products(self, gradient, cache)

    def vector_products(self, vectors: Tensor) -> Tensor:
        """Return ``xᵀ V_p``: ``b_cmᵀ x_W x_m`` (weight) or ``b_cmᵀ x_b`` (bias).

        Args:
            vectors: ``K`` vectors shaped like the parameter, ``[K, *p.shape]``.

        Returns:
            ``[K, C·N]`` products.
        """
        if self.inputs is None:
            products = torch.einsum("cmo,ko->kcm", self.backproped, vectors)
        else:
            mapped = torch.einsum("mi,koi->kmo", self.inputs, vectors)
            products = torch.einsum("cmo,kmo->kcm", self.backproped, mapped)
        return products.reshape(vectors.shape[0], -1)

    def _outer(self) -> Tensor:
        return self._rows @ self._rows.T

    def apply(self, vectors: Tensor, cache: LayerCache | None = None) -> Tensor:
        """Map Gram-space vectors: ``Σ_cn β_cn b_cn x_nᵀ`` as one matrix product.

        Args:
            vectors: ``[C·N]`` or ``[C·N, K]``.
            cache: Optional cache: weight and bias share the combination over ``c``.

        Returns:
            ``[*p.shape]`` or ``[K, *p.shape]``.
        """
        columns, leading = as_columns(vectors)
        num_outputs, num_samples, _ = self.backproped.shape
        weights = columns.reshape(num_outputs, num_samples, -1)
        # w[k, n, o] = Σ_c β_k[c, n] b[c, n, o]
        combined = cached(
            cache,
            Product.COMBINED,
            (vectors, self.backproped),
            lambda: torch.einsum("cnk,cno->kno", weights, self.backproped),
        )
        if self.inputs is None:
            result = combined.sum(1)
        else:
            result = combined.transpose(1, 2) @ self.inputs
        return result.reshape(*leading, *result.shape[1:])


def _position_rows(tensor: Tensor) -> Tensor:
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

    def gram(self, cache: LayerCache | None = None) -> Tensor:
        """Return ``Σ_pq (b_cnpᵀ b_dmq)(x_npᵀ x_mq)`` as ``[C·N, C·N]``.

        Args:
            cache: Optional cache of one layer.

        Returns:
            The Gram contribution.
        """
        num_outputs, num_samples, positions, _ = self.backproped.shape
        rows = _position_rows(self.backproped)
        kernel = cached(cache, Product.INPUT_KERNEL, (self.inputs,), self._input_kernel)
        size = (num_outputs, num_samples, positions) * 2
        products = (rows @ rows.T).view(size) * kernel.view(1, *size[1:3], 1, *size[4:])
        columns = num_outputs * num_samples
        return products.sum(dim=(2, 5)).reshape(columns, columns)

    def gradient_products(self, cache: LayerCache | None = None) -> Tensor:
        """Return ``Σ_pq (δ_npᵀ b_cmq)(x'_npᵀ x_mq)`` for the gradient samples.

        Args:
            cache: Optional cache of one layer.

        Returns:
            ``[N', C·N]`` products with the per-sample gradients.
        """
        num_outputs, num_samples, positions, _ = self.backproped.shape
        output_gradients = gathered(self.output_gradients, "output gradients")
        gradient_inputs = gathered(self.gradient_inputs, "gradient inputs")
        num_gradients = output_gradients.shape[0]
        if gradient_inputs is self.inputs:
            kernel = cached(
                cache, Product.INPUT_KERNEL, (self.inputs,), self._input_kernel
            )
        else:
            kernel = _position_rows(gradient_inputs) @ _position_rows(self.inputs).T
        products = _position_rows(output_gradients) @ _position_rows(self.backproped).T
        blocks = products.view(
            num_gradients, positions, num_outputs, num_samples, positions
        ) * kernel.view(num_gradients, positions, 1, num_samples, positions)
        return blocks.sum(dim=(1, 4)).reshape(num_gradients, -1)

    def mean_gradient_products(
        self, gradient: Tensor, cache: LayerCache | None = None
    ) -> Tensor:
        """``ḡᵀ V_p = Σ_q b_cmqᵀ ḡ x_mq``; see :func:`mean_products`."""
        return mean_products(self, gradient, cache)

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

    def apply(self, vectors: Tensor, cache: LayerCache | None = None) -> Tensor:
        """Map Gram-space vectors: ``Σ_cn β_cn Σ_p b_cnp x_npᵀ`` as one product.

        Args:
            vectors: ``[C·N]`` or ``[C·N, K]``.
            cache: Unused (the interface of :class:`~dampednewton.math.factors.Factor`).

        Returns:
            ``[*shape]`` or ``[K, *shape]``.
        """
        columns, leading = as_columns(vectors)
        num_outputs, num_samples, positions, out_features = self.backproped.shape
        weights = columns.reshape(num_outputs, num_samples, -1)
        combined = torch.einsum("cnk,cnpo->knpo", weights, self.backproped)
        combined = combined.reshape(-1, num_samples * positions, out_features)
        result = combined.transpose(1, 2) @ _position_rows(self.inputs)
        return result.reshape(*leading, *self.shape)

    def _input_kernel(self) -> Tensor:
        rows = _position_rows(self.inputs)
        return rows @ rows.T


def shared_weight_sqrt_ggn(backproped: Tensor, inputs: Tensor) -> Tensor:
    """Materialize the columns ``Σ_p b_cnp x_npᵀ`` of a weight shared over positions.

    One batched product over the samples per output column ``c``, written into the
    result: nothing larger than the result is formed (BackPACK's convolution route
    repeats the input for every column; one ``einsum`` permutes its result into a
    copy).

    Args:
        backproped: Back-propagated square root ``[C, N, P, d_out]``.
        inputs: Layer inputs ``[N, P, d_in]`` (unfolded for a convolution).

    Returns:
        ``[C, N, d_out, d_in]``.
    """
    num_outputs, num_samples, _, out_features = backproped.shape
    result = backproped.new_empty(
        num_outputs, num_samples, out_features, inputs.shape[-1]
    )
    for column in range(num_outputs):
        torch.bmm(backproped[column].transpose(1, 2), inputs, out=result[column])
    return result


def mean_products(
    factor: LinearFactor | SharedLinearFactor,
    gradient: Tensor,
    cache: LayerCache | None = None,
) -> Tensor:
    """Return ``ḡᵀ V_p`` of a linear layer's factor for its mean gradient ``ḡ``.

    With ``output_gradients`` (see
    :func:`~dampednewton.math.cost.mean_products_via_kernel`) the products are the
    mean of the factor's gradient products, which never touch ``ḡ`` (cheaper when
    ``N'·C < d_in``); otherwise they are ``gradient``'s vector products.

    Args:
        factor: A linear layer's factor.
        gradient: The parameter's mean gradient, shaped like the parameter.
        cache: Optional cache of one layer.

    Returns:
        ``[1, C·N]`` products.
    """
    if factor.output_gradients is not None:
        return factor.gradient_products(cache).mean(0, keepdim=True)
    return factor.vector_products(gradient.unsqueeze(0))
