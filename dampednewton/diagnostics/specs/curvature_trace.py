"""Curvature traces from BackPACK's diagonal curvature extensions.

Math and the extension per curvature in :mod:`dampednewton.diagnostics.trace`.
"""

from __future__ import annotations

from dataclasses import dataclass

from backpack.extensions.backprop_extension import BackpropExtension
from torch import Tensor

from dampednewton.backpack.savefields import DIAG_GGN_EXACT
from dampednewton.diagnostics.ranks import SINGLE_PROCESS, Ranks, summed_over_ranks
from dampednewton.diagnostics.reducer import Entries, NamedParams, pieces_of, quantity
from dampednewton.diagnostics.schedules import EveryKSteps, Schedule
from dampednewton.diagnostics.specs.checks import (
    check_count,
    check_label,
    check_schedule,
)
from dampednewton.diagnostics.trace import (
    check_curvature,
    curvature_extension,
    diagonal_trace,
    total_trace,
)

EVERY_STEP = EveryKSteps()
"""The default schedule (immutable, so one instance serves all)."""


# init=False: the constructor takes label=None (the curvature name), the field is a str.
@dataclass(frozen=True, init=False)
class CurvatureTrace:
    """Trace of a diagonal curvature (Hessian, exact or Monte-Carlo GGN).

    Record keys: ``{label}/trace`` (total) and ``{label}/trace/{name}``.

    Attributes:
        schedule: When to compute.
        curvature: ``"diag_h"``, ``"diag_ggn_exact"`` or ``"diag_ggn_mc"``.
        mc_samples: Monte-Carlo samples of ``diag_ggn_mc``.
        label: Key prefix (the curvature name unless given).
    """

    schedule: Schedule
    curvature: str
    mc_samples: int
    label: str

    def __init__(
        self,
        schedule: Schedule = EVERY_STEP,
        curvature: str = DIAG_GGN_EXACT,
        mc_samples: int = 1,
        label: str | None = None,
    ) -> None:
        """Validate the fields and fill in the defaults.

        Args:
            schedule: When to compute.
            curvature: ``"diag_h"``, ``"diag_ggn_exact"`` or ``"diag_ggn_mc"``.
            mc_samples: Monte-Carlo samples of ``diag_ggn_mc``.
            label: Key prefix; ``None`` uses the curvature name.

        Raises:
            ValueError: If the curvature, ``mc_samples`` or the label is invalid.
        """
        label = curvature if label is None else label
        check_schedule(schedule)
        check_curvature(curvature)
        check_count("mc_samples", mc_samples)
        check_label(label)
        for name, value in (
            ("schedule", schedule),
            ("curvature", curvature),
            ("mc_samples", mc_samples),
            ("label", label),
        ):
            object.__setattr__(self, name, value)

    def make_reducer(self) -> CurvatureTraceReducer:
        """A fresh :class:`CurvatureTraceReducer` that computes this diagnostic."""
        return CurvatureTraceReducer(self)


class CurvatureTraceReducer:
    """Traces of a diagonal curvature, per parameter and total."""

    def __init__(self, spec: CurvatureTrace) -> None:
        """Create the reducer.

        Args:
            spec: The trace diagnostic.
        """
        self.spec = spec
        self._ranks: Ranks = SINGLE_PROCESS
        self._pieces: dict[int, Tensor] = {}

    def extensions(self) -> list[BackpropExtension]:
        """Return the diagonal curvature extension of the spec."""
        return [curvature_extension(self.spec.curvature, self.spec.mc_samples)]

    def begin(self, ranks: Ranks) -> None:
        """Forget the previous step; this one's global batch is split over ``ranks``.

        Args:
            ranks: The ranks of the step's global batch.
        """
        self._ranks = ranks
        self._pieces = {}

    def reduce(self, param: Tensor, batch_size: int) -> None:
        """Sum the parameter's diagonal curvature.

        Args:
            param: Parameter whose module's backward just ran.
            batch_size: Number of samples (unused).
        """
        diagonal = quantity(param, self.spec.curvature)
        if diagonal is not None:
            self._pieces[id(param)] = diagonal_trace(diagonal)

    def assemble(self, named_params: NamedParams, batch_size: int) -> Entries:
        """Per-parameter traces and their total.

        Args:
            named_params: ``(name, param)`` pairs with gradients.
            batch_size: Number of samples (unused).

        Returns:
            Record entries (0-dim tensors).
        """
        key = f"{self.spec.label}/trace"
        local = [
            pieces_of(self._pieces, name, param, self.spec.curvature)
            for name, param in named_params
        ]
        # Each rank's trace is of its local mean loss: the global mean is their mean.
        world_size = self._ranks.world_size
        traces = [t / world_size for t in summed_over_ranks(local, self._ranks)]
        entries: Entries = {
            f"{key}/{name}": trace
            for (name, _), trace in zip(named_params, traces, strict=True)
        }
        entries[key] = total_trace(traces)
        return entries
