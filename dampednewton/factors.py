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

    def gram(self, shared: dict | None = None) -> Tensor:
        """Return the Gram contribution ``V_pᵀ V_p`` (``[C·N, C·N]``; no memo)."""
        return self.matrix @ self.matrix.T

    def gradient_products(self, shared: dict | None = None) -> Tensor:
        """Return ``g_nᵀ V_p`` for every per-sample gradient (``[N', C·N]``)."""
        return self.gradients @ self.matrix.T

    def mean_gradient_products(
        self, gradient: Tensor, shared: dict | None = None
    ) -> Tensor:
        """Return ``ḡᵀ V_p`` for one (mean) gradient shaped like the parameter.

        Args:
            gradient: The parameter's gradient.
            shared: Unused (the interface of :class:`LinearFactor`).

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

    def apply(self, vectors: Tensor, shared: dict | None = None) -> Tensor:
        """Map Gram-space vectors ``[C·N(, K)]`` to ``p.shape`` (``[K, *p.shape]``).

        Args:
            vectors: ``[C·N]`` or ``[C·N, K]``.
            shared: Unused (the interface of :class:`LinearFactor`).

        Returns:
            ``[*p.shape]`` or ``[K, *p.shape]``.
        """
        columns, leading = as_columns(vectors)
        return (columns.T @ self.matrix).reshape(*leading, *self.shape)


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
        num_outputs, num_samples, _ = self.backproped.shape
        kernel = memo(
            shared, ("XXᵀ", id(self.inputs)), lambda: self.inputs @ self.inputs.T
        )
        blocks = outer.view(num_outputs, num_samples, num_outputs, num_samples)
        return (blocks * kernel.view(1, num_samples, 1, num_samples)).view_as(outer)

    def gradient_products(self, shared: dict | None = None) -> Tensor:
        """Return ``(δ_nᵀ b_cm)(x'_nᵀ x_m)`` for the gradient samples ``[N', C·N]``.

        Args:
            shared: Optional memo, as for :meth:`gram`: the bias's products are the
                weight's before the kernel is applied.

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
        num_outputs, num_samples, _ = self.backproped.shape
        blocks = products.view(-1, num_outputs, num_samples)
        return (blocks * self.kernel.unsqueeze(1)).view_as(products)

    def mean_gradient_products(
        self, gradient: Tensor, shared: dict | None = None
    ) -> Tensor:
        """Return ``ḡᵀ V_p``: ``b_cmᵀ ḡ_W x_m`` (weight) or ``b_cmᵀ ḡ_b`` (bias).

        With ``output_gradients`` (see :func:`mean_products_via_kernel`) the products
        are the mean of :meth:`gradient_products`, which never touches ``ḡ`` (cheaper
        when ``N'·C < d_in``); otherwise they come from ``gradient``.

        Args:
            gradient: The parameter's mean gradient ``[d_out, d_in]`` or ``[d_out]``.
            shared: Optional memo, as for :meth:`gradient_products`.

        Returns:
            ``[1, C·N]`` products.
        """
        if self.output_gradients is not None:
            return self.gradient_products(shared).mean(0, keepdim=True)
        return self.vector_products(gradient.unsqueeze(0))

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

    def apply(self, vectors: Tensor, shared: dict | None = None) -> Tensor:
        """Map Gram-space vectors: ``Σ_cn β_cn b_cn x_nᵀ`` as one matrix product.

        Args:
            vectors: ``[C·N]`` or ``[C·N, K]``.
            shared: Optional memo: weight and bias share the combination over ``c``.

        Returns:
            ``[*p.shape]`` or ``[K, *p.shape]``.
        """
        columns, leading = as_columns(vectors)
        num_outputs, num_samples, _ = self.backproped.shape
        weights = columns.reshape(num_outputs, num_samples, -1)
        # w[k, n, o] = Σ_c β_k[c, n] b[c, n, o]
        combined = memo(
            shared,
            ("βB", id(vectors), id(self.backproped)),
            lambda: torch.einsum("cnk,cno->kno", weights, self.backproped),
        )
        if self.inputs is None:
            result = combined.sum(1)
        else:
            result = combined.transpose(1, 2) @ self.inputs
        return result.reshape(*leading, *result.shape[1:])


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
