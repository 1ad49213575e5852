"""Bytes moved to gather a linear layer's global batch: which route moves fewer.

Under data parallelism each rank all-gathers what the step needs of its local batch
(:class:`~dampednewton.backpack.global_batch.GlobalBatch`). For a structured layer
(``nn.Linear``, unfoldable convolutions) there are two exact routes:

* :attr:`Route.FACTORS`: the weight's buffers, i.e. the back-propagated square root
  ``[C, N, P, d_out]``, the layer inputs ``[N, P, d_in]`` and the output gradients
  ``[N', P, d_out]`` (and the inputs of the gradient samples when sub-sampling makes
  them differ from the GGN samples');
* :attr:`Route.SQRT_GGN`: the materialized square root ``V_p`` ``[C, N, d_out·d_in]``
  (and the per-sample gradients ``[N', d_out·d_in]`` when the step needs them).

The bias gathers its own buffers in both routes, except that a plain ``nn.Linear``'s
bias shares the weight's back-propagated square root and output gradients on the
factor route. Pure arithmetic on shapes: every rank decides identically.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Route(Enum):
    """What a structured layer gathers over the ranks."""

    FACTORS = "factors"
    SQRT_GGN = "sqrt_ggn"


@dataclass(frozen=True)
class LinearLayerShapes:
    """Shapes of one structured layer's buffers on one rank.

    Attributes:
        num_outputs: ``C``, square-root columns per sample.
        num_samples: ``N``, the rank's GGN samples.
        gradient_samples: ``N'``, the rank's gradient samples (its batch size
            without ``subsampling_grad``).
        positions: ``P`` for a weight shared over positions (sequence ``nn.Linear``,
            convolution); ``None`` for ``nn.Linear`` on ``[N, d_in]`` inputs.
        in_features: ``d_in`` (channels times kernel size for a convolution).
        out_features: ``d_out``.
        bias: Whether the layer's bias is reduced with it.
        subsampled: Whether the GGN and gradient samples differ (any sub-sampling),
            so the factor route gathers the gradient samples' inputs too.
        per_sample_gradients: Whether the step needs per-sample gradients.
    """

    num_outputs: int
    num_samples: int
    gradient_samples: int
    positions: int | None
    in_features: int
    out_features: int
    bias: bool
    subsampled: bool = False
    per_sample_gradients: bool = False

    def __post_init__(self) -> None:
        """Check the sizes.

        Raises:
            ValueError: For a size below one.
        """
        sizes = {
            "num_outputs": self.num_outputs,
            "num_samples": self.num_samples,
            "gradient_samples": self.gradient_samples,
            "positions": 1 if self.positions is None else self.positions,
            "in_features": self.in_features,
            "out_features": self.out_features,
        }
        for name, size in sizes.items():
            if size < 1:
                raise ValueError(f"{name} must be at least 1, got {size}.")


def gathered_numbers(layer: LinearLayerShapes) -> dict[Route, int]:
    """Numbers each rank contributes to the layer's all-gathers, for each route.

    Args:
        layer: The layer's shapes on one rank.

    Returns:
        Numbers per route.
    """
    columns = layer.num_outputs * layer.num_samples
    out_features, in_features = layer.out_features, layer.in_features
    positions = 1 if layer.positions is None else layer.positions
    own_bias = columns * out_features + layer.gradient_samples * out_features
    bias = own_bias if layer.bias else 0
    factors = positions * (
        columns * out_features
        + layer.num_samples * in_features
        + layer.gradient_samples * out_features
    )
    if layer.subsampled:
        factors += layer.gradient_samples * positions * in_features
    if layer.positions is not None:
        factors += bias  # a shared weight's bias sums over positions: its own tensors
    sqrt_ggn = columns * out_features * in_features + bias
    if layer.per_sample_gradients:
        sqrt_ggn += layer.gradient_samples * out_features * in_features
    return {Route.FACTORS: factors, Route.SQRT_GGN: sqrt_ggn}


def bytes_received(
    layer: LinearLayerShapes, world_size: int, element_size: int
) -> dict[Route, int]:
    """Bytes one rank receives to gather the layer, for each route.

    Args:
        layer: The layer's shapes on one rank (equal on every rank).
        world_size: Number of ranks ``R``: each receives ``R − 1`` contributions.
        element_size: Bytes per number (4 for float32, 8 for float64).

    Returns:
        Bytes per route.
    """
    return {
        route: (world_size - 1) * numbers * element_size
        for route, numbers in gathered_numbers(layer).items()
    }


def cheaper_route(layer: LinearLayerShapes) -> Route:
    """The route that moves fewer bytes (the factors on a tie).

    Args:
        layer: The layer's shapes on one rank.

    Returns:
        The route.
    """
    numbers = gathered_numbers(layer)
    if numbers[Route.SQRT_GGN] < numbers[Route.FACTORS]:
        return Route.SQRT_GGN
    return Route.FACTORS
