"""ViViT-compatible GGN computations on BackPACK."""

from dampednewton.computations.damped_newton import (
    DirectionalDampedNewtonComputation,
    NewtonStep,
)
from dampednewton.computations.directional_derivatives import (
    DirectionalDerivativesComputation,
)
from dampednewton.computations.eigh import EighComputation
from dampednewton.computations.eigvalsh import EigvalshComputation

__all__ = [
    "DirectionalDampedNewtonComputation",
    "DirectionalDerivativesComputation",
    "EighComputation",
    "EigvalshComputation",
    "NewtonStep",
]
