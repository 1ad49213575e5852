"""Schedule-Free averaging of the steps: a value of the optimizer's ``momentum``.

With a constant step length (the Kronecker basis' trust region binds on every step)
the parameters end up moving about a minimum by the gradient's noise. Schedule-Free
(Defazio et al., 2024, "The Road Less Scheduled") lets a fast iterate ``z`` take the
steps, averages it into ``x`` and takes the gradient at ``y = (1 − β) z + β x``, which
the parameters hold (the update: ``dampednewton._step.update``).
Its uniform average of every iterate lags where a model keeps improving; here the
newest iterate weighs ``c_t = min(1, k/(t + 1))``, so the average covers about the
last ``1/k`` of the run (``k = 1``: Schedule-Free's uniform average).

Measured (docs/benchmarks.md): with ``kl_clip=1e-2`` it ended higher on the
Fashion-MNIST problems (fmnist_2c2d reached 0.9 in as many steps as SOAP), level on
the small MNIST-1D models, and with a higher test error on a regression; hence opt-in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ScheduleFree:
    """Schedule-Free's interpolation and an average weighted toward recent steps.

    With the step ``Δ_t`` (``lr·νs`` and the decoupled weight decay, taken at the
    parameters ``y_t``): ``z ← z + Δ_t``, ``x ← (1 − c_t) x + c_t z`` and
    ``y = (1 − β) z + β x``, with ``c_t = min(1, k/(t + 1))`` at the ``t``-th step.

    Attributes:
        interpolation: ``β`` in ``[0, 1)``: where the gradient is taken, between the
            fast iterate (0) and the average (Schedule-Free's 0.9).
        recency: ``k >= 1``: the newest iterate's weight in the average (1:
            Schedule-Free's uniform average of all iterates).
    """

    interpolation: float = 0.9
    recency: float = 4.0

    def __post_init__(self) -> None:
        """Validate the settings."""
        for name in ("interpolation", "recency"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(
                    f"ScheduleFree's {name} must be a number, got {value!r}."
                )
        if not 0 <= self.interpolation < 1:
            raise ValueError(
                "ScheduleFree needs 0 <= interpolation < 1 (where the gradient is "
                "taken, between the fast iterate and the average), got "
                f"{self.interpolation!r}."
            )
        if not (math.isfinite(self.recency) and self.recency >= 1):
            raise ValueError(
                "ScheduleFree needs a finite recency >= 1 (1: the uniform average of "
                f"all iterates), got {self.recency!r}."
            )

    def weight(self, step: int) -> float:
        """``c_t``: the weight of the ``step``-th iterate (from 1) in the average."""
        return min(1.0, self.recency / (step + 1))


# Param groups carry the policy (as their momentum): ``torch.load(weights_only=True)``
# of a state dict needs it allowlisted.
torch.serialization.add_safe_globals([ScheduleFree])
