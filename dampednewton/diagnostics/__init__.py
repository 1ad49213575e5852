"""Training diagnostics computed inside one BackPACK backward pass.

* What to compute (:mod:`~dampednewton.diagnostics.specs`, each spec with its
  reducer, :mod:`~dampednewton.diagnostics.reducer`): :class:`GSNR`,
  :class:`NoiseScale`, :class:`GradientHistogram`,
  :class:`GradientParameterHistogram`, :class:`CurvatureTrace`, each with a
  schedule (:class:`EveryKSteps`, :class:`DecadeSchedule`,
  :class:`LogSpacedSchedule`) and, for histograms, a bin-range policy
  (:class:`FixedRange`, :class:`MaxAbsRange`, :class:`PercentileRange`) and
  :data:`HistogramSemantics` (this package's or Cockpit's).
* How: :class:`DiagnosticsMonitor` (BackPACK extensions, extension hook, per-step
  record), :class:`DiagnosticsLog` (JSON/NPZ storage, and sinks that also get
  each record: :class:`TensorBoardSink`, :class:`LightningLoggerSink`, see
  :mod:`~dampednewton.diagnostics.sinks`).
* Math as pure functions: :mod:`~dampednewton.diagnostics.gsnr`,
  :mod:`~dampednewton.diagnostics.histogram`,
  :mod:`~dampednewton.diagnostics.bin_adaptation`,
  :mod:`~dampednewton.diagnostics.trace`.
* Plots (needs matplotlib): :mod:`dampednewton.diagnostics.plots`.
"""

from dampednewton.diagnostics.bin_adaptation import (
    FixedRange,
    MaxAbsRange,
    PercentileRange,
)
from dampednewton.diagnostics.log import DiagnosticsLog, RecordSink
from dampednewton.diagnostics.monitor import DiagnosticsMonitor
from dampednewton.diagnostics.reducer import MissingQuantityError
from dampednewton.diagnostics.schedules import (
    DecadeSchedule,
    EveryKSteps,
    LogSpacedSchedule,
)
from dampednewton.diagnostics.sinks import LightningLoggerSink, TensorBoardSink
from dampednewton.diagnostics.specs import (
    GSNR,
    CurvatureTrace,
    GradientHistogram,
    GradientParameterHistogram,
    HistogramSemantics,
    NoiseScale,
)

__all__ = [
    "GSNR",
    "CurvatureTrace",
    "DecadeSchedule",
    "DiagnosticsLog",
    "DiagnosticsMonitor",
    "EveryKSteps",
    "FixedRange",
    "GradientHistogram",
    "GradientParameterHistogram",
    "HistogramSemantics",
    "LightningLoggerSink",
    "LogSpacedSchedule",
    "MaxAbsRange",
    "MissingQuantityError",
    "NoiseScale",
    "PercentileRange",
    "RecordSink",
    "TensorBoardSink",
]
