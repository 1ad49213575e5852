"""The GGN and gradient approximation of a computation: :class:`GGNSettings`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Generator

from dampednewton.policies.checks import (
    check_integer,
    check_subsampling,
    check_warn_small_eigvals,
)


@dataclass(frozen=True)
class GGNSettings:
    """The GGN and gradient approximation of a computation, validated.

    ViViT's keywords map onto these once: ``subsampling`` (eigenvalue and eigenpair
    computations) is ``subsampling_ggn``, ``mc_samples_ggn`` (directional
    derivatives, damped Newton) is ``mc_samples``.

    Attributes:
        subsampling_ggn: Samples for the GGN (directions, curvatures), ``None``: all.
        subsampling_grad: Samples for the gradients; ``None``: all.
        mc_samples: ``0`` for the exact GGN, else the number of Monte-Carlo samples
            of the loss Hessian's square root.
        verbose: Print what happens during backpropagation.
        warn_small_eigvals: Warn when a selected eigenvalue's magnitude is below.
        generator: Random source for Monte-Carlo sampling (``None``: global).
        structured: Exploit the Kronecker structure of the layers in
            :data:`~dampednewton.backpack.layers.LAYERS` instead of materializing
            their square roots and individual gradients.
        ggn_argument: What the user's call named ``subsampling_ggn`` (for errors).
    """

    subsampling_ggn: Sequence[int] | None = None
    subsampling_grad: Sequence[int] | None = None
    mc_samples: int = 0
    verbose: bool = False
    warn_small_eigvals: float = 1e-4
    generator: Generator | None = None
    structured: bool = True
    ggn_argument: str = "subsampling_ggn"

    def __post_init__(self) -> None:
        """Validate the settings and store sub-sampling indices as lists.

        Raises:
            TypeError: For a non-integer ``mc_samples``, a non-number
                ``warn_small_eigvals`` or non-integer sub-sampling indices.
            ValueError: For negative ``mc_samples`` or ``warn_small_eigvals``, or
                empty, negative or repeated sub-sampling indices.
        """
        for name, argument in self.arguments():
            indices = check_subsampling(getattr(self, name), argument)
            object.__setattr__(self, name, indices)
        object.__setattr__(
            self, "mc_samples", check_integer("mc_samples", self.mc_samples, 0)
        )
        object.__setattr__(
            self,
            "warn_small_eigvals",
            check_warn_small_eigvals(self.warn_small_eigvals),
        )

    def arguments(self) -> tuple[tuple[str, str], ...]:
        """``(field, the user's argument name)`` of the two sub-samplings."""
        return (
            ("subsampling_ggn", self.ggn_argument),
            ("subsampling_grad", "subsampling_grad"),
        )
