"""Per-group policies: the basis, which directions (criteria), damping, the complement.

Each policy kind has one module with its protocol, its built-in rules (picklable
dataclasses) and the shorthand conversion (``as_criterion``, ``as_damping``,
``as_complement``):

* :mod:`~dampednewton.policies.basis`: :class:`KroneckerBasis`, :class:`GramBasis`;
* :mod:`~dampednewton.policies.criteria`: :class:`Criterion` (``evals -> indices``);
* :mod:`~dampednewton.policies.damping`: :class:`Damping`, :class:`AdaptiveDamping`
  and the base :class:`MeanStatisticsDamping`;
* :mod:`~dampednewton.policies.complement`: :class:`ComplementPolicy` (``ρ``);
* :mod:`~dampednewton.policies.noise_filter`: :class:`NoiseFilter` (the Kronecker
  basis' per-direction scale);
* :mod:`~dampednewton.policies.schedule_free`: :class:`ScheduleFree` (Schedule-Free
  averaging of the steps, a value of ``momentum``).
"""

from dampednewton.policies.basis import Basis, GramBasis, KroneckerBasis
from dampednewton.policies.complement import (
    ComplementPolicy,
    ConstantCurvature,
    MeasuredCurvature,
    SmallestCurvature,
)
from dampednewton.policies.criteria import (
    Criterion,
    EigenvalueThreshold,
    RelativeThreshold,
    TopK,
)
from dampednewton.policies.damping import (
    AdaptiveDamping,
    ConstantDamping,
    Damping,
    GSNRDamping,
    LevenbergMarquardt,
    MeanStatisticsDamping,
    NoiseAwareDamping,
    RelativeDamping,
)
from dampednewton.policies.noise_filter import NoiseFilter
from dampednewton.policies.schedule_free import ScheduleFree

__all__ = [
    "AdaptiveDamping",
    "Basis",
    "ComplementPolicy",
    "ConstantCurvature",
    "ConstantDamping",
    "Criterion",
    "Damping",
    "EigenvalueThreshold",
    "GSNRDamping",
    "GramBasis",
    "KroneckerBasis",
    "LevenbergMarquardt",
    "MeanStatisticsDamping",
    "MeasuredCurvature",
    "NoiseAwareDamping",
    "NoiseFilter",
    "RelativeDamping",
    "RelativeThreshold",
    "ScheduleFree",
    "SmallestCurvature",
    "TopK",
]
