"""A GGN block: its running reductions, and the map from Gram to parameter space."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import Tensor

from dampednewton.math.factors import Factor, LayerCache
from dampednewton.math.precision import computation_dtype, upcast


@dataclass
class Block:
    """Running reductions of one GGN block during a backward pass.

    Attributes:
        group: The parameter group that defines the block.
        pending: ``id``s of trainable parameters not reached yet.
        gram: Running Gram matrix ``VᵀV`` (``[C·N, C·N]``).
        gradient_products: Running ``[N', C·N]`` products of per-sample gradients with
            ``V``, when gradients are needed.
        factors: Square-root factors by parameter ``id``, kept only when eigenvectors
            or steps are mapped back to parameter space.
        num_outputs: ``C``, square-root columns per sample (classes or MC samples).
        num_samples: ``N``, the samples that built the Gram matrix.
    """

    group: dict
    pending: set[int]
    gram: Tensor | None = None
    gradient_products: Tensor | None = None
    factors: dict[int, Factor] = field(default_factory=dict)
    num_outputs: int = 0
    num_samples: int = 0

    @property
    def reduced_gram(self) -> Tensor:
        """The Gram matrix ``VᵀV`` once at least one parameter was reduced.

        Raises:
            RuntimeError: Before any reduction.
        """
        if self.gram is None:
            raise RuntimeError("The block's Gram matrix was not reduced yet.")
        return self.gram


def to_parameter_space(block: Block, gram_vectors: Tensor) -> list[Tensor]:
    """Map Gram-space vectors ``[C·N(, K)]`` to each parameter of the block.

    Parameters that do not require gradients are outside the GGN block: they get
    zeros.

    Args:
        block: A finished block that kept its factors.
        gram_vectors: Vector ``[C·N]`` or matrix ``[C·N, K]``.

    Returns:
        One tensor per parameter, shaped ``p.shape`` (or ``[K, *p.shape]``).
    """
    leading = tuple(gram_vectors.shape[1:])
    cache = LayerCache()  # a layer's weight and bias share work
    mapped = []
    for param in block.group["params"]:
        factor = block.factors.get(id(param))
        if factor is None:
            mapped.append(
                torch.zeros(
                    *leading,
                    *param.shape,
                    dtype=computation_dtype(param.dtype),
                    device=param.device,
                )
            )
        else:
            mapped.append(factor.apply(gram_vectors, cache))
    return mapped


def mean_gradient_products(
    block: Block, mean_gradient_of: Callable[[Tensor], Tensor]
) -> Tensor:
    """``ḡᵀV`` (``[1, C·N]``) of the block's factors for the mean gradient ``ḡ``.

    Args:
        block: A finished block that kept its factors.
        mean_gradient_of: The mean gradient of a parameter (shaped like it).

    Returns:
        The products summed over the block's parameters.
    """
    cache = LayerCache()  # a layer's weight and bias share products
    return cast(
        Tensor,
        sum(
            block.factors[id(p)].mean_gradient_products(mean_gradient_of(p), cache)
            for p in block.group["params"]
            if id(p) in block.factors
        ),
    )


def slope_products(block: Block, per_sample_gradients: bool) -> Tensor:
    """The gradient products that give the directional slopes ``γ``.

    Args:
        block: A finished block that kept its factors.
        per_sample_gradients: Whether the block reduced per-sample gradients;
            otherwise the mean gradient ``ḡ`` is read from the parameters' ``.grad``.

    Returns:
        ``[N', C·N]`` per-sample products, or ``[1, C·N]`` of the mean gradient.

    Raises:
        RuntimeError: When a parameter of the block has no ``.grad``.
    """
    if per_sample_gradients:
        if block.gradient_products is None:
            raise RuntimeError("The block reduced no per-sample gradient products.")
        return block.gradient_products
    return mean_gradient_products(block, mean_gradient_of)


def mean_gradient_of(param: Tensor) -> Tensor:
    """A parameter's mean gradient ``.grad`` after the backward pass.

    Args:
        param: A parameter of a finished block.

    Returns:
        Its ``.grad`` (in float32 for half-precision parameters).

    Raises:
        RuntimeError: When it has none.
    """
    if param.grad is None:
        raise RuntimeError(
            "A parameter of the block has no .grad after the backward pass; with "
            "per_sample_gradients=False, call get_result before zeroing gradients."
        )
    return upcast(param.grad)
