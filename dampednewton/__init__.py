"""Directionally damped Newton steps from the GGN's low-rank structure, on BackPACK."""

from dampednewton._step.defaults import basis_defaults
from dampednewton.averaging import CurvatureAveraging
from dampednewton.computations import (
    DirectionalDampedNewtonComputation,
    DirectionalDerivativesComputation,
    EighComputation,
    EigvalshComputation,
    NewtonStep,
)
from dampednewton.optimizer import DampedNewton
from dampednewton.policies.basis import GramBasis, KroneckerBasis
from dampednewton.policies.complement import (
    ConstantCurvature,
    MeasuredCurvature,
    SmallestCurvature,
)
from dampednewton.policies.criteria import EigenvalueThreshold, RelativeThreshold, TopK
from dampednewton.policies.damping import (
    ConstantDamping,
    GSNRDamping,
    LevenbergMarquardt,
    NoiseAwareDamping,
    RelativeDamping,
)
from dampednewton.policies.noise_filter import NoiseFilter
from dampednewton.policies.schedule_free import ScheduleFree

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
    "GramBasis",
    "KroneckerBasis",
    "LevenbergMarquardt",
    "MeasuredCurvature",
    "NewtonStep",
    "NoiseAwareDamping",
    "NoiseFilter",
    "RelativeDamping",
    "RelativeThreshold",
    "ScheduleFree",
    "SmallestCurvature",
    "TopK",
    "basis_defaults",
]
