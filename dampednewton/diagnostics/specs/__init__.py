"""What to compute: one small frozen (picklable) dataclass per diagnostic.

Each diagnostic has a :mod:`schedule <dampednewton.diagnostics.schedules>`, a
``label`` that prefixes its keys in the per-step record, and ``make_reducer()``,
which creates its :class:`~dampednewton.diagnostics.reducer.Reducer`. Keys are
``"{label}/{field}"`` for the whole network and ``"{label}/{field}/{name}"`` for the
parameter called ``name``. A new diagnostic is one module here (spec and reducer).
"""

from dampednewton.diagnostics.specs.curvature_trace import CurvatureTrace
from dampednewton.diagnostics.specs.histograms import (
    GradientHistogram,
    GradientParameterHistogram,
    HistogramSemantics,
)
from dampednewton.diagnostics.specs.noise import GSNR, NoiseScale

__all__ = [
    "GSNR",
    "CurvatureTrace",
    "GradientHistogram",
    "GradientParameterHistogram",
    "HistogramSemantics",
    "NoiseScale",
]
