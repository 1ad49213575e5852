"""Directionally damped Newton steps from the GGN's low-rank structure, on BackPACK."""

from dampednewton.computations import (
    DirectionalDampedNewtonComputation,
    DirectionalDerivativesComputation,
    EighComputation,
    EigvalshComputation,
    NewtonStep,
)
from dampednewton.criteria import EigenvalueThreshold, RelativeThreshold, TopK
from dampednewton.damping import (
    ConstantDamping,
    GSNRDamping,
    LevenbergMarquardt,
    NoiseAwareDamping,
)
from dampednewton.optimizer import DampedNewton

__all__ = [
    "ConstantDamping",
    "DampedNewton",
    "DirectionalDampedNewtonComputation",
    "DirectionalDerivativesComputation",
    "EigenvalueThreshold",
    "EighComputation",
    "EigvalshComputation",
    "GSNRDamping",
    "LevenbergMarquardt",
    "NewtonStep",
    "NoiseAwareDamping",
    "RelativeThreshold",
    "TopK",
]
