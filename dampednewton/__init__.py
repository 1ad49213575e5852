"""Directionally damped Newton steps from the GGN's low-rank structure, on BackPACK."""

from dampednewton.averaging import CurvatureAveraging
from dampednewton.complement import (
    ConstantCurvature,
    MeasuredCurvature,
    SmallestCurvature,
)
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
    RelativeDamping,
)
from dampednewton.optimizer import DampedNewton

__all__ = [
    "ConstantCurvature",
    "ConstantDamping",
    "CurvatureAveraging",
    "DampedNewton",
    "DirectionalDampedNewtonComputation",
    "DirectionalDerivativesComputation",
    "EigenvalueThreshold",
    "EighComputation",
    "EigvalshComputation",
    "GSNRDamping",
    "LevenbergMarquardt",
    "MeasuredCurvature",
    "NewtonStep",
    "NoiseAwareDamping",
    "RelativeDamping",
    "RelativeThreshold",
    "SmallestCurvature",
    "TopK",
]
